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

local fingerprint = ARGV[1]
local now = tonumber(ARGV[2]) - 1
if now < 0 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
local leases = redis.call('ZRANGE', KEYS[1], '0', '-1', 'WITHSCORES')
local released, expired, latest, mine = 0, 0, 0, {}
for j = 1, #leases, 2 do
  local member, expiry = leases[j], tonumber(leases[j + 1])
  if expiry <= now then
    expired = expired + 1
  elseif string.sub(member, 1, 5) == fingerprint then
    local u1, u2 = string.byte(member, 6, 7)
    released = released + u1 * 256 + u2
    mine[#mine + 1] = member
  else
    latest = expiry
  end
end
if #mine == 0 and expired == 0 then
  return 0
end
if expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now))
end
if #mine > 0 then
  redis.call('ZREM', KEYS[1], unpack(mine))
end
if latest > 0 then
  redis.call('PEXPIRE', KEYS[1], string.format('%d', latest - now + tonumber(ARGV[3])))
end
return released
