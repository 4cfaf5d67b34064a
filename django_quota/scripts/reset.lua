--[[ reset.lua: delete a subject's counter for one policy revision (django-quota, contract 6).

KEYS:
  KEYS[1]  the counter hash of (policy, revision, identity)
ARGV:
  1  m, the policy's window count
Reply (integer): how many windows had state (fields c1..cm present); the hash is deleted.
Evaluation-id records are separate keys and stay.
]]

local m = tonumber(ARGV[1])
local with_state = 0
for w = 1, m do
  if redis.call('HEXISTS', KEYS[1], 'c' .. w) == 1 then
    with_state = with_state + 1
  end
end
redis.call('DEL', KEYS[1])
return with_state
