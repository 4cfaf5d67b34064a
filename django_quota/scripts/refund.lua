--[[ refund.lua: give back charges evaluate.lua made for one request (django-quota;
docs/cluster.md).

Redis Cluster only. A group whose policies live in several hash slots is evaluated one slot
at a time; when a later slot refuses the request, the charges already made in earlier
slots are given back with this script, one call per slot. Best effort: it restores the
count of the window that was charged, and leaves alone a window that has moved on.

Integer arithmetic only; every division goes through floor_div. No key name is built here.
The counter's value has evaluate.lua's layout (its header): the ledger, d, t, then the
windows' numbers.

KEYS (1 per policy i = 1..n, all in one hash slot, then the sliding logs):
  KEYS[i]  the counter evaluate.lua charged for policy i
  then, for each sliding_log policy in order, its windows' lists (as for evaluate.lua)
ARGV:
  1  n, the number of policies
  2  the evaluation's fingerprint (5 bytes), whose entries leave each counter's ledger,
     so that a later repeat of the refused evaluation is decided afresh
  then per policy: algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket,
       4 sliding_log, 5 fixed_window with calendar windows),
       cost (integer >= 1, the units charged),
       charged now (ms: the effective now evaluate.lua returned for the charge, which it
                    stored as t),
       window count m,
       then per window: period (ms); for algorithm 5 also the start and end (ms) of the
       window charged (the one of charged now among the boundaries evaluate.lua had)
Reply (integer): how many windows were refunded.

Per window i of period P:
  fixed_window    c<i> -= cost (never below 0) only while t's window is the charged one
                  (t - t mod P == charged now - charged now mod P; with calendar
                  windows, start <= t < end);
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
A missing counter (expired), or one without numbers (reset), keeps its numbers as they
are. Neither t nor the expiry changes.
]]

local byte, char, sub, floor, max = string.byte, string.char, string.sub, math.floor, math.max

local function floor_div(a, b)
  local q = floor(a / b)
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
local ENTRY = 9  -- bytes of a ledger entry, as evaluate.lua

local function u48(s, i)
  local a, b, c, d, e, f = byte(s, i, i + 5)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

local function bytes48(x)
  local out = {}
  for j = 6, 1, -1 do
    local rest = floor(x / 256)
    out[j] = x - rest * 256
    x = rest
  end
  return char(unpack(out))
end

-- Takes cost units out of the newest event at or before `at` of a sliding log whose
-- window count is count; the new count, or nil when nothing was taken.
local function log_refund(count, key, at, cost)
  local size = redis.call('LLEN', key)
  local events = floor_div(size, 2)
  local found = 0
  for event = 1, events do
    if tonumber(redis.call('LINDEX', key, 2 * event - 2)) <= at then
      found = event
      break
    end
  end
  if found == 0 then return nil end
  local newer = count  -- the count before the next newer event, or c<i>
  if found > 1 then newer = tonumber(redis.call('LINDEX', key, 2 * found - 3)) end
  local units = mod(newer - tonumber(redis.call('LINDEX', key, 2 * found - 1)), LOG_MODULUS)
  if units < cost then return nil end
  for event = 1, found - 1 do
    local before = tonumber(redis.call('LINDEX', key, 2 * event - 1))
    redis.call('LSET', key, 2 * event - 1, mod(before - cost, LOG_MODULUS))
  end
  if units == cost then
    redis.call('LSET', key, 2 * found - 2, 'refunded')
    redis.call('LSET', key, 2 * found - 1, 'refunded')
    redis.call('LREM', key, 2, 'refunded')
  end
  return mod(count - cost, LOG_MODULUS)
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
  local value = redis.pcall('GET', KEYS[i])
  if type(value) ~= 'string' then value = '' end  -- none, or not a counter of this version
  if value ~= '' then
    local ledger_end = 1 + ENTRY * byte(value, 1)
    local kept = {}
    for j = 2, ledger_end - 1, ENTRY do
      if sub(value, j, j + 4) ~= fingerprint then
        kept[#kept + 1] = sub(value, j, j + ENTRY - 1)
      end
    end
    local parts = {char(#kept), table.concat(kept), sub(value, ledger_end + 1, ledger_end + 6)}
    local numbers = ledger_end + 7
    if #value > ledger_end + 6 then
      local last = u48(value, numbers)
      parts[4] = sub(value, numbers, numbers + 5)
      local stride = 1
      if algorithm == 2 or algorithm == 3 then stride = 2 end
      local field = numbers + 6
      local width = 1  -- arguments per window
      if algorithm == 5 then width = 3 end
      for w = 1, m do
        local period = tonumber(ARGV[position + width * (w - 1)])
        local count = u48(value, field)
        local extra = 0
        if stride == 2 then extra = u48(value, field + 6) end
        if algorithm == 4 then
          local left = log_refund(count, KEYS[log_position], charged_now, cost)
          log_position = log_position + 1
          if left ~= nil then
            count = left
            refunded = refunded + 1
          end
        elseif algorithm == 3 then
          local deficit = max(0, count * period + extra - cost * period)
          count = floor_div(deficit, period)
          extra = deficit - count * period
          refunded = refunded + 1
        elseif algorithm == 5 then  -- a calendar call: t still in the window charged
          local start = tonumber(ARGV[position + 3 * (w - 1) + 1])
          local finish = tonumber(ARGV[position + 3 * (w - 1) + 2])
          if last >= start and last < finish then
            count = max(0, count - cost)
            refunded = refunded + 1
          end
        else
          local stored_start = last - mod(last, period)
          local charged_start = charged_now - mod(charged_now, period)
          if stored_start == charged_start then
            count = max(0, count - cost)
            refunded = refunded + 1
          elseif algorithm == 2 and stored_start == charged_start + period then
            extra = max(0, extra - cost)
            refunded = refunded + 1
          end
        end
        parts[#parts + 1] = bytes48(count)
        if stride == 2 then parts[#parts + 1] = bytes48(extra) end
        field = field + 6 * stride
      end
    elseif algorithm == 4 then
      log_position = log_position + m
    end
    local refreshed = table.concat(parts)
    if refreshed ~= value then redis.call('SET', KEYS[i], refreshed, 'KEEPTTL') end
  elseif algorithm == 4 then
    log_position = log_position + m
  end
  position = position + m
  if algorithm == 5 then position = position + 2 * m end  -- start and end per window
end
return refunded
