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
neither is deleted; so is a value not in that layout and another type at the key (a hash
of an earlier version). A concurrency policy's key is its leases' sorted set
(docs/concurrency.md): deleted, its window counted as having had state.
]]

local value = redis.pcall('GET', KEYS[1])
local with_state = 0
if type(value) == 'string' then
  local entries = string.byte(value, 1) or 255  -- "" is no counter either
  local kept = 1 + 9 * entries + 6  -- the ledger's count and entries, and d
  if entries > 8 or #value < kept then
    redis.call('DEL', KEYS[1])  -- not a counter's layout: nothing worth keeping
  elseif #value > kept then
    with_state = tonumber(ARGV[1])
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
