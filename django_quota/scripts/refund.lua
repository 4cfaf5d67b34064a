--[[ refund.lua: give back charges evaluate.lua made (django-quota; docs/refunds.md,
docs/cluster.md).

Two modes. Mode 0, best effort (Redis Cluster): a group whose policies live in several
hash slots is evaluated one slot at a time; when a later slot refuses the request, the
charges already made in earlier slots are given back, one call per slot, at the charge's
own now. Mode 1, at most once (django_quota.refund, and the edges' count_when): a
counter is refunded only while its ledger holds the evaluation's fingerprint, whose
entry gives the charge time; mode 1 mirrors django_quota/core/refunds.py
(refund_counter), and the differential tests hold the two to the same replies and state.

Integer arithmetic only; every division goes through floor_div. No key name is built here.
The counter's value has evaluate.lua's layout (its header): the ledger's length, its
entries (each with the cost it charged when that is not 1), d, t, then the windows'
numbers; a value in another layout (an earlier version's) is left alone.

KEYS (1 per policy i = 1..n, all in one hash slot, then the sliding logs):
  KEYS[i]  the counter evaluate.lua charged for policy i
  then, for each sliding_log policy in order, its windows' lists (as for evaluate.lua)
ARGV:
  1  n, the number of policies
  2  the evaluation's fingerprint (5 bytes, its first bit 0), whose entries leave each
     counter's ledger (whatever cost they record), so that a later repeat of the
     refunded evaluation is decided afresh
  3  mode: 0 best effort, 1 at most once
  4  mode 1: now + 1, integer ms since the epoch (0: Redis TIME, µs floored to ms); mode 0: 0
  then per policy: algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket,
       4 sliding_log, 5 fixed_window with calendar windows),
       cost: mode 0, the units charged (integer >= 1); mode 1, the most units to give
             back (0: what the ledger entry says was charged; an edge's measured
             refund, whose entry is gone, gives this many),
       charged now (ms; mode 0: the effective now evaluate.lua returned for the charge,
                    which it stored as t; mode 1: 0, or the ms since the charge + 1 as
                    an edge measured them, used only when the bounded ledger no longer
                    holds the entry),
       window count m,
       then per window: period (ms) and two numbers: for algorithm 5 the start and end
       (ms) of the window (mode 0: the one charged, of charged now; mode 1: the one of
       the client's now), for algorithm 3 its limit and 0, else 0 and 0
Reply (integer): mode 0, how many windows were refunded; mode 1, the units refunded (per
policy the units given back when some window gave them back).

The charge time: mode 0, charged now; mode 1, recovered from the ledger entry's stamp
(charge time modulo 2^32 ms) and t: t - ((t - stamp) mod 2^32); when the ledger dropped
the entry (more than 8 charges of the counter since) and the caller gave the ms since
the charge, the reference minus those ms, never after t (then a sliding log's units
leave the newest event at or before it, as in mode 0). The reference time a
window must still be current at: mode 0, t; mode 1, now clamped to t. Per window i of
period P:
  fixed_window    c<i> -= cost (never below 0) only while the reference's window is the
                  charge's; with calendar windows, start <= charge time and
                  start <= reference < end;
  sliding_window  the same; and, mode 0 only, when t has moved into the next window,
                  where the charged window's count is now p<i>, p<i> -= cost (never
                  below 0);
  token_bucket    the deficit c<i>·P + p<i> -= cost·P (never below 0), split again into
                  c<i> = floor(deficit / P), p<i> = deficit mod P; mode 1 only while the
                  bucket is not full at the reference;
  sliding_log     the cost units recorded at the charge time leave the log: mode 0, the
                  newest event at or before that time (its own event; for a charge
                  replayed by a retry, reported at the retry's now, the nearest one
                  before); mode 1, the event at exactly that time (else, when an edge's
                  measured refund took that one, the newest before it), while it is
                  inside (reference - P, reference]. It loses them, so every newer event's count
                  before it and c<i> drop by cost (modulo LOG_MODULUS); an event left with
                  no unit is removed. Found from the newest event, as a refund follows its
                  charge closely. Nothing is done when that event holds fewer than cost
                  units (expired, reset).
A missing counter (expired), or one without numbers (reset), keeps its numbers as they
are; in mode 1 a counter whose ledger does not hold the fingerprint is not written at
all. Neither t nor the expiry changes.
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
local STAMP = 4294967296  -- a ledger entry's charge time is kept modulo 2^32 ms

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

-- Takes cost units out of the newest event at or before `at` (exact: the event at `at`)
-- of a sliding log whose window count is count; the new count, or nil when nothing was
-- taken.
local function log_refund(count, key, at, cost, exact)
  local size = redis.call('LLEN', key)
  local events = floor_div(size, 2)
  local found = 0
  for event = 1, events do
    local time = tonumber(redis.call('LINDEX', key, 2 * event - 2))
    if time <= at then
      if time == at or not exact then found = event end
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
local fingerprint = ARGV[2] or ''
local first_byte, rest = byte(fingerprint, 1), sub(fingerprint, 2, 5)
local at_most_once = tonumber(ARGV[3]) == 1
local now = -1
if at_most_once then now = tonumber(ARGV[4]) - 1 end
if now < 0 and at_most_once then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + floor(tonumber(time[2]) / 1000)
end
local position = 5
local refunded, refunded_units = 0, 0  -- windows (mode 0), units (mode 1)
for i = 1, n do
  local algorithm = tonumber(ARGV[position])
  local cost = tonumber(ARGV[position + 1])
  local charged_now = tonumber(ARGV[position + 2])
  local m = tonumber(ARGV[position + 3])
  position = position + 4
  local value = redis.pcall('GET', KEYS[i])
  if type(value) ~= 'string' then value = '' end  -- none, or not a counter of this version
  local exact = at_most_once  -- a sliding log's event at exactly the charge time
  local stride = 1
  if algorithm == 2 or algorithm == 3 then stride = 2 end
  local ledger_end = 1
  if value ~= '' then
    ledger_end = 1 + byte(value, 1)
    local size = #value
    if size ~= ledger_end + 6 and size ~= ledger_end + 12 + 6 * stride * m then
      value = ''  -- not in evaluate.lua's layout (an earlier version's): left alone
    end
  end
  if value ~= '' then
    -- The entries, each 9 bytes, or 15 when its first bit says a cost follows its
    -- fingerprint; the evaluation's first entry gives its charge time and cost.
    local kept = {}
    local kept_length = 0
    local stamp = nil
    local charged_cost = cost
    local j = 2
    while j < ledger_end do
      local first = byte(value, j)
      local size, entry_cost = 9, 1
      if first >= 128 then
        first = first - 128
        size = 15
        entry_cost = u48(value, j + 5)
      end
      if first ~= first_byte or sub(value, j + 1, j + 4) ~= rest then
        kept[#kept + 1] = sub(value, j, j + size - 1)
        kept_length = kept_length + size
      elseif stamp == nil then
        local b1, b2, b3, b4 = byte(value, j + size - 4, j + size - 1)
        stamp = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
        charged_cost = entry_cost
      end
      j = j + size
    end
    if at_most_once and stamp ~= nil and cost > 0 and cost < charged_cost then
      charged_cost = cost  -- the caller gives back a part of the charge
    end
    if at_most_once then cost = charged_cost end
    local since = charged_now - 1  -- mode 1: ms since the charge, as the caller measured
    local measured = false
    if at_most_once and stamp == nil and since >= 0 and cost > 0 then
      measured = true  -- an edge's refund whose entry the bounded ledger dropped
      exact = false
    end
    if stamp ~= nil or measured or not at_most_once then
      local parts = {char(kept_length), table.concat(kept),
        sub(value, ledger_end + 1, ledger_end + 6)}
      local numbers = ledger_end + 7
      local units = 0
      if #value > ledger_end + 6 then
        local last = u48(value, numbers)
        local reference = last
        if at_most_once then
          if now > last then reference = now end
          if measured then  -- the caller's measure, never after t
            charged_now = reference - since
            if charged_now > last then charged_now = last end
          else
            charged_now = last - mod(last - stamp, STAMP)
          end
        end
        parts[4] = sub(value, numbers, numbers + 5)
        local field = numbers + 6
        for w = 1, m do
          local at = position + 3 * (w - 1)
          local period = tonumber(ARGV[at])
          local count = u48(value, field)
          local extra = 0
          if stride == 2 then extra = u48(value, field + 6) end
          if algorithm == 4 then
            if not at_most_once or charged_now > reference - period then
              local key = KEYS[log_position + w - 1]
              local left = log_refund(count, key, charged_now, cost, exact)
              if left == nil and exact then  -- its event went to an edge's measured refund
                left = log_refund(count, key, charged_now, cost, false)
              end
              if left ~= nil then
                count = left
                refunded = refunded + 1
                units = cost
              end
            end
          elseif algorithm == 3 then
            local deficit = count * period + extra
            local limit = tonumber(ARGV[at + 1])
            if not at_most_once or reference - last < -floor_div(-deficit, limit) then
              deficit = max(0, deficit - cost * period)
              count = floor_div(deficit, period)
              extra = deficit - count * period
              refunded = refunded + 1
              units = cost
            end
          elseif algorithm == 5 then  -- a calendar call: the reference in the window charged
            local start = tonumber(ARGV[at + 1])
            local finish = tonumber(ARGV[at + 2])
            if charged_now >= start and reference >= start and reference < finish then
              count = max(0, count - cost)
              refunded = refunded + 1
              units = cost
            end
          else
            local reference_start = reference - mod(reference, period)
            local charged_start = charged_now - mod(charged_now, period)
            if reference_start == charged_start then
              count = max(0, count - cost)
              refunded = refunded + 1
              units = cost
            elseif algorithm == 2 and not at_most_once
                and reference_start == charged_start + period then
              extra = max(0, extra - cost)
              refunded = refunded + 1
            end
          end
          parts[#parts + 1] = bytes48(count)
          if stride == 2 then parts[#parts + 1] = bytes48(extra) end
          field = field + 6 * stride
        end
      end
      local refreshed = table.concat(parts)
      if refreshed ~= value then redis.call('SET', KEYS[i], refreshed, 'KEEPTTL') end
      if at_most_once then refunded_units = refunded_units + units end
    end
  end
  if algorithm == 4 then log_position = log_position + m end
  position = position + 3 * m
end
if at_most_once then return refunded_units end
return refunded
