--[[ reset.lua: forget a subject's counter for one policy revision (django-quota;
docs/failures.md, "reset").

KEYS:
  KEYS[1]        the counter hash of (policy, revision, identity)
  KEYS[2..m+1]   its sliding-log lists, one per window (absent for other algorithms)
ARGV:
  1  m, the policy's window count
Reply (integer): how many windows had state (fields c1..cm present).
Deletes the numbers (t, c1..cm, p1..pm) and the sliding-log lists; the evaluation-id
ledger (e, d) stays, so that a retry of an evaluation charged before the reset still never
charges twice. A hash left with no field is removed by Redis itself.
]]

local m = tonumber(ARGV[1])
local names = {'t'}
local with_state = 0
for w = 1, m do
  if redis.call('HEXISTS', KEYS[1], 'c' .. w) == 1 then
    with_state = with_state + 1
  end
  names[#names + 1] = 'c' .. w
  names[#names + 1] = 'p' .. w
end
redis.call('HDEL', KEYS[1], unpack(names))
if #KEYS > 1 then
  redis.call('DEL', unpack(KEYS, 2))
end
return with_state
