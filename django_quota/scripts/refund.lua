--[[ refund.lua: give back charges evaluate.lua made for one request (django-quota, docs/cluster.md).

Redis Cluster only. A group whose policies live in several hash slots is evaluated one slot
at a time; when a later slot refuses the request, the charges already made in earlier
slots are given back with this script, one call per slot. Best effort: it restores the
count of the window that was charged, and leaves alone a window that has moved on.

Integer arithmetic only; every division goes through floor_div. No number is formatted
into a string; no key name is built here.

KEYS (1 per policy i = 1..n, all in one hash slot, then the sliding logs):
  KEYS[i]  the counter hash evaluate.lua charged for policy i
  then, for each sliding_log policy in order, its windows' lists (as for evaluate.lua)
ARGV:
  1  n, the number of policies
  2  the evaluation's fingerprint (5 bytes), whose entries leave each counter's ledger
     (fields e and s)
     (field e), so that a later repeat of the refused evaluation is decided afresh
  then per policy: algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket,
       4 sliding_log),
       cost (integer >= 1, the units charged),
       charged now (ms: the effective now evaluate.lua returned for the charge, which it
                    stored as t),
       window count m,
       then per window: period (ms)
Reply (integer): how many windows were refunded.

Per window i of period P:
  fixed_window    c<i> -= cost (never below 0) only while t's window is the charged one
                  (t - t mod P == charged now - charged now mod P);
  sliding_window  the same; and when t has moved into the next window, where the charged
                  window's count is now p<i>, p<i> -= cost (never below 0);
  token_bucket    the deficit c<i>·P + p<i> -= cost·P (never below 0), split again into
                  c<i> = floor(deficit / P), p<i> = deficit mod P;
  sliding_log     the cost units recorded at charged now leave the log: the newest event
                  at or before that time (its own event; for a charge replayed by a retry,
                  reported at the retry's now, the nearest one before) loses them, so
                  every newer event's count before it and c<i> drop by cost (modulo
                  LOG_MODULUS); an event left with no unit is removed. Found from the
                  newest event, as a refund follows its charge closely. Nothing is done
                  when that event holds fewer than cost units (expired, reset).
A missing hash (expired, reset) is left alone. Neither t nor the TTL changes.
]]

local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function mod(a, b)
  return a - floor_div(a, b) * b
end

local LOG_MODULUS = 1000000000000  -- as evaluate.lua

-- Takes cost units out of the newest event at or before `at` of a sliding log; whether
-- it did.
local function log_refund(counter, field, key, at, cost)
  local count = tonumber(redis.call('HGET', counter, field))
  if count == nil then return false end
  local size = redis.call('LLEN', key)
  local events = floor_div(size, 2)
  local found = 0
  for event = 1, events do
    if tonumber(redis.call('LINDEX', key, 2 * event - 2)) <= at then
      found = event
      break
    end
  end
  if found == 0 then return false end
  local newer = count  -- the count before the next newer event, or c<i>
  if found > 1 then newer = tonumber(redis.call('LINDEX', key, 2 * found - 3)) end
  local units = mod(newer - tonumber(redis.call('LINDEX', key, 2 * found - 1)), LOG_MODULUS)
  if units < cost then return false end
  for event = 1, found - 1 do
    local before = tonumber(redis.call('LINDEX', key, 2 * event - 1))
    redis.call('LSET', key, 2 * event - 1, mod(before - cost, LOG_MODULUS))
  end
  redis.call('HSET', counter, field, mod(count - cost, LOG_MODULUS))
  if units == cost then
    redis.call('LSET', key, 2 * found - 2, 'refunded')
    redis.call('LSET', key, 2 * found - 1, 'refunded')
    redis.call('LREM', key, 2, 'refunded')
  end
  return true
end

local n = tonumber(ARGV[1])
local log_position = n + 1  -- KEYS index of the next sliding log
local fingerprint = ARGV[2]
local position = 3
local refunded = 0
for i = 1, n do
  local algorithm = tonumber(ARGV[position])
  local cost = tonumber(ARGV[position + 1])
  local charged_now = tonumber(ARGV[position + 2])
  local m = tonumber(ARGV[position + 3])
  position = position + 4
  local last = tonumber(redis.call('HGET', KEYS[i], 't'))
  local prints = redis.call('HGET', KEYS[i], 'e')
  if prints then
    local stamps = redis.call('HGET', KEYS[i], 's') or ''
    local kept_prints, kept_stamps = '', ''
    for j = 0, #prints / 5 - 1 do  -- 5-byte fingerprints in e, their 4-byte times in s
      local print = string.sub(prints, 5 * j + 1, 5 * j + 5)
      if print ~= fingerprint then
        kept_prints = kept_prints .. print
        kept_stamps = kept_stamps .. string.sub(stamps, 4 * j + 1, 4 * j + 4)
      end
    end
    if kept_prints ~= prints then
      redis.call('HSET', KEYS[i], 'e', kept_prints, 's', kept_stamps)
    end
  end
  for w = 1, m do
    local period = tonumber(ARGV[position + w - 1])
    if algorithm == 4 then
      if last ~= nil and log_refund(KEYS[i], 'c' .. w, KEYS[log_position], charged_now, cost) then
        refunded = refunded + 1
      end
      log_position = log_position + 1
    elseif last ~= nil then
      local count = tonumber(redis.call('HGET', KEYS[i], 'c' .. w)) or 0
      local extra = tonumber(redis.call('HGET', KEYS[i], 'p' .. w)) or 0
      if algorithm == 3 then
        local deficit = math.max(0, count * period + extra - cost * period)
        local whole = floor_div(deficit, period)
        redis.call('HSET', KEYS[i], 'c' .. w, whole, 'p' .. w, deficit - whole * period)
        refunded = refunded + 1
      else
        local stored_start = last - mod(last, period)
        local charged_start = charged_now - mod(charged_now, period)
        if stored_start == charged_start then
          redis.call('HSET', KEYS[i], 'c' .. w, math.max(0, count - cost))
          refunded = refunded + 1
        elseif algorithm == 2 and stored_start == charged_start + period then
          redis.call('HSET', KEYS[i], 'p' .. w, math.max(0, extra - cost))
          refunded = refunded + 1
        end
      end
    end
  end
  position = position + m
end
return refunded
