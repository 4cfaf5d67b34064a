--[[ reset.lua: forget a subject's counter for one policy revision (django-quota;
docs/failures.md, "reset").

KEYS:
  KEYS[1]        the counter of (policy, revision, identity): a string in evaluate.lua's
                 layout (its header)
  KEYS[2..m+1]   its sliding-log lists, one per window (absent for other algorithms)
ARGV:
  1  m, the policy's window count
Reply (integer): how many windows had state (m when the counter had numbers, else 0).
Drops the numbers (t and every window's) and deletes the sliding-log lists; the
evaluation-id ledger and d stay, with the counter's expiry, so that a retry of an
evaluation charged before the reset still never charges twice. A counter left with
neither is deleted; so is a value not in that layout (a length that fits no policy of m
windows; an earlier version's string, which starts with an entry count) and another type
at the key (a hash of an earlier version). A concurrency policy's key is its leases' sorted set
(docs/concurrency.md): deleted, its window counted as having had state.
]]

local value = redis.pcall('GET', KEYS[1])
local with_state = 0
if type(value) == 'string' then
  local length = string.byte(value, 1) or 255  -- "" is no counter either
  local kept = 1 + length + 6  -- the ledger's length and entries, and d
  local size, m = #value, tonumber(ARGV[1])
  -- A ledger is empty or holds an entry (9 bytes at least), 72 bytes at most; then d, and
  -- t with one or two numbers per window, or nothing (an earlier version's counters,
  -- whose first byte is an entry count of 1 to 8, fail this).
  if (length > 0 and length < 9) or length > 72
    or (size ~= kept and size ~= kept + 6 + 6 * m and size ~= kept + 6 + 12 * m)
  then
    redis.call('DEL', KEYS[1])  -- not a counter's layout: nothing worth keeping
  elseif size > kept then
    with_state = m
    if kept == 7 and string.sub(value, 2, 7) == '\0\0\0\0\0\0' then
      redis.call('DEL', KEYS[1])
    else
      redis.call('SET', KEYS[1], string.sub(value, 1, kept), 'KEEPTTL')
    end
  end
elseif type(value) == 'table' then
  if string.sub(tostring(value.err), 1, 9) ~= 'WRONGTYPE' then return value end
  if redis.call('TYPE', KEYS[1]).ok == 'zset' then with_state = tonumber(ARGV[1]) end
  redis.call('DEL', KEYS[1])
end
if #KEYS > 1 then
  redis.call('DEL', unpack(KEYS, 2))
end
return with_state
