--[[ release.lua: free the leases one evaluation acquired from a concurrency policy
(django-quota; docs/concurrency.md).

Mirrors django_quota/core/leases.py (release_leases). A concurrency policy's key is a
sorted set, one member per held lease: the 5-byte fingerprint of the evaluation that
acquired it, then its units (2 bytes, big-endian), scored by its expiry (ms); evaluate.lua
adds them.

KEYS:
  KEYS[1]  the policy's lease set for one identity (its counter key)
ARGV:
  1  the evaluation's fingerprint (5 bytes)
  2  now + 1, integer ms since the epoch (0: Redis TIME, µs floored to ms)
  3  cleanup grace (CLEANUP_GRACE), ms
Reply (integer): the units released: those of the evaluation's leases held at now
(expiring after it); 0 when none (released already, expired, never acquired, or lost in
a failover). So releasing twice releases once.
Writes: ZREM of the evaluation's members and ZREMRANGEBYSCORE of the expired ones (the
key goes when none is left), then, when some lease is left and something was removed,
PEXPIRE until the latest expires, plus the grace. Nothing when nothing is removed.
]]

-- A decimal string is made a number by the arithmetic (Lua's coercion, x + 0: one
-- strtod, where tonumber() converts twice).
local fingerprint = ARGV[1]
local now = ARGV[2] - 1
if now < 0 then
  -- Redis TIME in ms, read as evaluate.lua reads it.
  local time = redis.call('TIME')
  local ms = time[2] / 1000
  now = time[1] * 1000 + (ms - ms % 1)
end
local leases = redis.call('ZRANGE', KEYS[1], '0', '-1', 'WITHSCORES')
-- The evaluation's members: the first, then a table of the others only when there are
-- (an evaluation holds one lease of a set; a table made per call costs more).
local released, expired, latest, first, others = 0, 0, 0, nil, nil
for j = 1, #leases, 2 do
  local member, expiry = leases[j], leases[j + 1] + 0
  if expiry <= now then
    expired = expired + 1
  elseif string.sub(member, 1, 5) == fingerprint then
    local u1, u2 = string.byte(member, 6, 7)
    released = released + u1 * 256 + u2
    if first == nil then
      first = member
    elseif others == nil then
      others = {member}
    else
      others[#others + 1] = member
    end
  else
    latest = expiry
  end
end
if first == nil and expired == 0 then
  return 0
end
if expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
end
if others ~= nil then
  redis.call('ZREM', KEYS[1], first, unpack(others))
elseif first ~= nil then
  redis.call('ZREM', KEYS[1], first)
end
if latest > 0 then
  redis.call('PEXPIRE', KEYS[1], string.format('%d', latest - now + ARGV[3]))
end
return released
