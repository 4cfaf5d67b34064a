--[[ evaluate.lua: decide a group of policies atomically (django-quota; docs/arithmetic.md).

Mirrors django_quota/core/model.py function by function; the differential tests hold
the two to identical replies and identical stored state. Integer arithmetic only, in
doubles: every operand and product stays below 2^53 in magnitude (the policy bounds
guarantee it), so floor(a / b) is the exact integer quotient (the rounding error of
a / b is below 1 / b, the least distance from a non-integer quotient to an integer) and
a % b, which Lua computes as a - floor(a / b) * b, the exact remainder, non-negative
for b > 0 (docs/arithmetic.md).

Cost: the script runs on every decision, so it avoids what Redis's Lua makes expensive
(measured in instructions per call, docs/benchmarks.md): tonumber() on a decimal string
(strtod), a Lua number passed to redis.call or concatenated (formatted through "%.17g"),
a closure or table made per call, and every extra command. Hence binary arguments and a
binary counter value: one GET and one SET (with its expiry) per charged counter.

KEYS (1 per policy i = 1..n, in call order, then the sliding logs):
  KEYS[i]  the counter of (policy, revision, identity): a string (layout below)
  then, for each sliding_log policy in call order, one list per window w = 1..m: the
  window's log (the counter key with l<w> before its "{": same hash tag, same slot)
ARGV:
  1  the evaluation id's fingerprint (5 bytes; "" when peeking)
  2  every number, packed (core/protocol.py packs it): unsigned big-endian integers,
     "u8" one byte, "u16" two, "u64" eight (every value below 2^48, so the script
     reads only the low six bytes)
       u8 mode: 0 = a fresh evaluation id; 1 = it may repeat an earlier one (search the
                ledgers first); 2 = peek (decide as cost 1 would and write nothing)
       u16 n, the number of policies
       u64 now + 1, integer ms since the epoch; 0 = read Redis TIME (µs floored to ms)
       u64 max clock regression + 1, ms; 0 = clamp silently (server clock)
       u64 DEDUP_TTL, ms: a charged counter lives at least this long; ledger entries
           younger than this are remembered, and dropping one makes a possible repeat
           indeterminate
       u64 cleanup grace (CLEANUP_GRACE), ms
     then per policy: u8 algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket,
       4 sliding_log), u8 enforce (1 enforce, 0 shadow), u16 window count m, u64 cost,
       then per window: u64 limit, u64 period (ms), u64 capacity
Reply (integers only):
  { group status (0 decided, 1 clock unsafe, 2 indeterminate, 3 replayed),
    then per policy (only when 0 or 3): status (0 denied, 1 allowed and charged, now
                     or, when replayed, by the earlier evaluation; 2 allowed, not
                     charged), effective now (ms),
                     then per window of a fixed window, sliding window counter or token
                       bucket: its view before this call (model._view): used (the fixed
                       count, the sliding window's current count, the bucket's scaled
                       deficit) and prev (the sliding window's previous count, else 0),
                       from which the client computes the reported numbers with the
                       model's own arithmetic (model.window_result: every one follows
                       from the view, now, the window and the cost);
                     per window of a sliding log: remaining, reset_after (ms),
                       retry_after (ms, -1 unless this window denied or replayed),
                       replenish_after (ms until remaining next rises), which need its
                       list }
Writes: for each charged policy, one SET of its counter with PX (its lifetime), or, on
the server clock, with KEEPTTL when the expiry it has is late enough (model.keeps_expiry); a
sliding log also, per window: LPUSH of a new event (none when its newest event is at
now), LTRIM of the events that left (only when some did; DEL instead when all did) and
PEXPIRE (period + grace: until the unit just recorded leaves). A denial, a peek and a
replay write nothing.

Counter value (core/protocol.py decodes it; "u48" = 6 bytes big-endian):
  u8 k, the ledger's entry count (0..8), then its k entries, oldest first, 9 bytes each:
     the 5-byte fingerprint of a charged evaluation, then its charge time modulo 2^32 ms
     (4 bytes);
  u48 d + 1: d = charge time (ms) of the newest entry dropped while younger than
     DEDUP_TTL (0: none; see model.py);
  then, unless the numbers were reset: u48 t (the last accepted now, ms), and per window
     u48 c<w>, followed, for the sliding window counter and the token bucket, by u48 p<w>.
  Another type at the key (a hash of an earlier version) reads as no counter, and the
  first charge replaces it.

Sliding log (algorithm 4, docs/arithmetic.md): c<i> counts every unit window i ever
recorded, modulo LOG_MODULUS; its list holds, newest event first, two integers an event:
the now (ms) of an admission, then c<i> just before it. Admissions at one now share an
event. Reads per window: LLEN, LINDEX of the newest time, of the oldest time and of the
oldest inside's count; a binary search (LINDEX) only when some events have left, and
one more (over the counts) only when the window denies. So O(log L) commands, and O(1)
per charge whatever its cost.
]]

local byte, char, sub, format = string.byte, string.char, string.sub, string.format
local floor, max = math.floor, math.max

local LEDGER_SIZE = 8
local ENTRY = 9  -- bytes of a ledger entry: 5 of fingerprint, 4 of charge time
local STAMP = 4294967296
local LOG_MODULUS = 1000000000000  -- sliding-log counts wrap here (model.LOG_MODULUS)

-- The six bytes of x (0 <= x < 2^48), most significant first: remainders and exact
-- divisions by 256, no C call (char(split48(x)) is x as a u48).
local function split48(x)
  local b6 = x % 256
  x = (x - b6) / 256
  local b5 = x % 256
  x = (x - b5) / 256
  local b4 = x % 256
  x = (x - b4) / 256
  local b3 = x % 256
  x = (x - b3) / 256
  local b2 = x % 256
  return (x - b2) / 256, b2, b3, b4, b5, b6
end

local fingerprint, packed = ARGV[1], ARGV[2]

local mode, n_high, n_low = byte(packed, 1, 3)
local n = n_high * 256 + n_low
local peek = mode == 2
local now
do
  local a, b, c, d, e, f = byte(packed, 6, 11)
  now = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f - 1
end
-- Whether now is on the clock expiries follow (Redis TIME): only then may a charge keep
-- its counter's expiry (model.keeps_expiry).
local server_clock = now < 0
if now < 0 then
  -- Redis TIME in ms, read from its digits: ten of seconds (until 2286), then the µs
  -- without leading zeros, whose digits but the last three are the whole ms.
  local time = redis.call('TIME')
  local seconds, micros = time[1], time[2]
  if #seconds == 10 then
    local a, b, c, d, e, f, g, h, i, j = byte(seconds, 1, 10)
    now = (((((((((a * 10 + b) * 10 + c) * 10 + d) * 10 + e) * 10 + f) * 10 + g) * 10 + h)
      * 10 + i) * 10 + j - 53333333328) * 1000  -- 48 * 1111111111: the digits' zeros
  else
    now = tonumber(seconds) * 1000
  end
  local digits = #micros - 3
  if digits == 3 then
    local a, b, c = byte(micros, 1, 3)
    now = now + a * 100 + b * 10 + c - 5328
  elseif digits == 2 then
    local a, b = byte(micros, 1, 2)
    now = now + a * 10 + b - 528
  elseif digits == 1 then
    now = now + byte(micros, 1) - 48
  end
end
-- DEDUP_TTL and the grace are read when something may be charged or searched for; the
-- clock bound only when a counter is ahead of now.
local dedup_ttl, grace = 0, 0
if not peek then
  local a, b, c, d, e, f, _, _, g, h, i, j, k, l = byte(packed, 22, 35)
  dedup_ttl = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
  grace = ((((g * 256 + h) * 256 + i) * 256 + j) * 256 + k) * 256 + l
end

-- One array per policy: 1 algorithm, 2 enforced, 3 window count, 4 cost, 5 byte of its
-- first window in the packed arguments, 6 its counter value ('' for none), 7 t (nil for
-- none), 8 the effective now, 9 KEYS index of its first log, 10 u48s a window (1: c<w>;
-- 2: c<w>, p<w>), 11 byte of the ledger's end (the byte before d), then 12 allowed,
-- 13 whether every window is the stored t's, and from 14 the windows' views, 4 values
-- each (set while deciding).
local policies = {nil, nil}  -- nil slots make room ahead (a table grown rehashes)
local offset = 36
local log_index = n + 1  -- KEYS index of the next sliding log
local has_log = false
for i = 1, n do
  local algorithm, enforce, m_high, m_low, _, _, c1, c2, c3, c4, c5, c6 =
    byte(packed, offset, offset + 11)
  local m = m_high * 256 + m_low
  local cost = ((((c1 * 256 + c2) * 256 + c3) * 256 + c4) * 256 + c5) * 256 + c6
  local first = offset + 12
  offset = first + 24 * m
  local value = redis.pcall('GET', KEYS[i])
  if type(value) == 'table' then  -- an error: only another type at the key is no counter
    if sub(tostring(value.err), 1, 9) ~= 'WRONGTYPE' then return value end
    value = ''
  elseif not value then
    value = ''
  end
  local stride = 1
  if algorithm == 2 or algorithm == 3 then stride = 2 end
  local ledger_end, last = 1, nil
  if value ~= '' then
    local entries = byte(value, 1)
    ledger_end = 1 + ENTRY * entries
    local size = #value
    if size == ledger_end + 12 + 6 * stride * m then
      local a, b, c, d, e, f = byte(value, ledger_end + 7, ledger_end + 12)
      last = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
    elseif entries > LEDGER_SIZE or size ~= ledger_end + 6 then
      return redis.error_reply('django-quota: the value at ' .. KEYS[i] ..
        ' is not a counter of this policy (docs/operations.md); reset it')
    end
  end
  local effective = now
  if last ~= nil and now < last then
    local a, b, c, d, e, f = byte(packed, 14, 19)
    local max_regression = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f - 1
    if max_regression >= 0 and last - now > max_regression then
      return {1}
    end
    effective = last
  end
  local logs = 0
  if algorithm == 4 then
    logs = log_index
    log_index = log_index + m
    has_log = true
  end
  policies[i] = {algorithm, enforce == 1, m, cost, first, value, last, effective, logs, stride,
    ledger_end, false, false, nil, nil, nil, nil}  -- room for one window's view
end

-- Whether the ledger of value (entries up to byte ledger_end) holds the fingerprint in an
-- entry charged less than DEDUP_TTL before now.
local remembers
if mode == 1 then
  remembers = function(value, ledger_end, at_now)
    for i = 2, ledger_end - 1, ENTRY do
      if sub(value, i, i + 4) == fingerprint then
        local b1, b2, b3, b4 = byte(value, i + 5, i + 8)  -- its charge time modulo 2^32
        if (at_now - (((b1 * 256 + b2) * 256 + b3) * 256 + b4)) % STAMP < dedup_ttl then
          return true
        end
      end
    end
    return false
  end
end

local replay = false
if mode == 1 then
  for i = 1, n do
    local policy = policies[i]
    if remembers(policy[6], policy[11], policy[8]) then
      replay = true
      break
    end
  end
  if not replay then
    for i = 1, n do
      local policy = policies[i]
      if policy[6] ~= '' then
        local a, b, c, d, e, f = byte(policy[6], policy[11] + 1, policy[11] + 6)
        local dropped = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f - 1
        if dropped >= 0 and policy[8] - dropped < dedup_ttl then
          return {2}
        end
      end
    end
  end
end

-- The sliding log's functions (model._log_view, _log_wait, _log_result, _charged_log),
-- made only for a group that has one.
local log_view, log_result, log_charge
if has_log then
  local function decimal(x)  -- an integer as redis.call takes it, without "%.17g"
    return format('%d', x)
  end

  -- The units inside (now - period, now], held by the `inside` newest events; the newest
  -- time and the oldest inside's (0 when inside is 0); the events stored.
  log_view = function(key, count, at_now, period)
    local size = redis.call('LLEN', key)
    local events = floor(size / 2)
    if events == 0 then return {used = 0, inside = 0, newest = 0, oldest = 0, events = 0} end
    local edge = at_now - period  -- a unit recorded at or before it has left
    local newest = tonumber(redis.call('LINDEX', key, '0'))
    if newest <= edge then
      return {used = 0, inside = 0, newest = 0, oldest = 0, events = events}
    end
    local inside = events
    local oldest = tonumber(redis.call('LINDEX', key, decimal(2 * events - 2)))
    if oldest <= edge then
      local low, high = 1, events  -- low is inside, high is not
      oldest = newest
      while high - low > 1 do
        local middle = floor((low + high) / 2)
        local time = tonumber(redis.call('LINDEX', key, decimal(2 * middle - 2)))
        if time > edge then
          low = middle
          oldest = time
        else
          high = middle
        end
      end
      inside = low
    end
    local before = tonumber(redis.call('LINDEX', key, decimal(2 * inside - 1)))
    return {used = (count - before) % LOG_MODULUS, inside = inside, newest = newest,
      oldest = oldest, events = events}
  end

  -- ms until cost fits in a window it does not fit now: until the unit of rank
  -- limit - cost + 1 (newest first) leaves, at its time + period.
  local function log_wait(key, limit, period, lv, at_now, cost)
    if lv.inside == 0 then return period end
    local rank = max(1, limit - cost + 1)
    local low, high = 0, lv.inside  -- events 1..low hold fewer than rank units, 1..high enough
    while high - low > 1 do
      local middle = floor((low + high) / 2)
      local before = tonumber(redis.call('LINDEX', key, decimal(2 * middle - 1)))
      if (lv.count - before) % LOG_MODULUS >= rank then
        high = middle
      else
        low = middle
      end
    end
    return tonumber(redis.call('LINDEX', key, decimal(2 * high - 2))) + period - at_now
  end

  -- Sets out[at + 1 .. at + 4] to the window's numbers; returns the ttl.
  log_result = function(out, at, key, limit, period, lv, at_now, cost, charged, replayed)
    local counted, reset_after, replenish
    if charged then
      counted = lv.used + cost
      reset_after = period
      replenish = period
      if lv.inside > 0 then replenish = lv.oldest + period - at_now end
    else
      counted = lv.used
      reset_after = 0
      replenish = 0
      if lv.inside > 0 then
        reset_after = lv.newest + period - at_now
        replenish = lv.oldest + period - at_now
      end
    end
    local retry_after = -1
    if lv.used + cost > limit then
      retry_after = log_wait(key, limit, period, lv, at_now, cost)
    end
    if replayed then retry_after = -1 end
    local remaining = 0
    if counted < limit then remaining = limit - counted end
    out[at + 1] = remaining
    out[at + 2] = reset_after
    out[at + 3] = retry_after
    out[at + 4] = replenish
    return reset_after
  end

  -- Records a charge at now: a new newest event (time, count before it) unless the
  -- newest is at now; drops the events that left.
  log_charge = function(key, period, lv, at_now)
    if lv.inside > 0 and lv.newest == at_now then
      if lv.inside < lv.events then
        redis.call('LTRIM', key, '0', decimal(2 * lv.inside - 1))
      end
    else
      if lv.inside == 0 and lv.events ~= 0 then redis.call('DEL', key) end
      redis.call('LPUSH', key, decimal(lv.count), decimal(at_now))
      if lv.inside > 0 and lv.inside < lv.events then
        redis.call('LTRIM', key, '0', decimal(2 * lv.inside + 1))
      end
    end
    redis.call('PEXPIRE', key, decimal(period + grace))
  end
end

-- Decide every window. A window's view is 4 values (used, prev, limit, period);
-- a sliding log's prev is its log view instead (a table; its count is lv.count).
local commit = not peek and not replay
for i = 1, n do
  local policy = policies[i]
  local algorithm, m, first, value = policy[1], policy[3], policy[5], policy[6]
  local last, policy_now, stride = policy[7], policy[8], policy[10]
  local numbers = policy[11] + 13  -- byte of c1
  local cost = policy[4]
  if peek then cost = 1 end
  local allowed = true
  -- Whether every window is still the one of the stored t (fixed window and sliding
  -- window counter only): then a charge may keep the counter's expiry (model.keeps_expiry).
  local same_windows = last ~= nil and (algorithm == 1 or algorithm == 2)
  local views = policy  -- the windows' views follow the policy's 13 fields
  for w = 1, m do
    local at = first + 24 * (w - 1)
    local l1, l2, l3, l4, l5, l6, _, _, p1, p2, p3, p4, p5, p6 = byte(packed, at + 2, at + 15)
    local limit = ((((l1 * 256 + l2) * 256 + l3) * 256 + l4) * 256 + l5) * 256 + l6
    local period = ((((p1 * 256 + p2) * 256 + p3) * 256 + p4) * 256 + p5) * 256 + p6
    local base = 13 + 4 * (w - 1)
    local count, extra = 0, 0
    if last ~= nil then
      local field = numbers + 6 * stride * (w - 1)
      if stride == 2 then
        local a, b, c, d, e, f, g, h, i, j, k, l = byte(value, field, field + 11)
        count = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
        extra = ((((g * 256 + h) * 256 + i) * 256 + j) * 256 + k) * 256 + l
      else
        local a, b, c, d, e, f = byte(value, field, field + 5)
        count = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
      end
    end
    if algorithm == 4 then
      local lv = {used = 0, inside = 0, newest = 0, oldest = 0, events = -1}
      if last ~= nil then  -- no numbers: whatever a list holds is not this counter's
        lv = log_view(KEYS[policy[9] + w - 1], count, policy_now, period)
      end
      lv.count = count
      views[base + 1], views[base + 2], views[base + 3], views[base + 4] = lv.used, lv, limit,
        period
      if lv.used + cost > limit then allowed = false end
    else
      -- The window seen at now (model._view): used (the fixed count, the sliding cur, the
      -- bucket's deficit) and prev; then whether cost fits (model._allows).
      local capacity, used, prev = 0, 0, 0
      if algorithm == 1 then
        if last ~= nil and policy_now - policy_now % period == last - last % period then
          used = count
        else
          same_windows = false
        end
        if used + cost > limit then allowed = false end
      elseif algorithm == 3 then
        local a, b, c, d, e, f = byte(packed, at + 18, at + 23)
        capacity = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
        if last ~= nil then
          local deficit = count * period + extra
          local elapsed = policy_now - last
          if elapsed < -floor((-deficit) / limit) then used = deficit - elapsed * limit end
        end
        if used + cost * period > capacity * period then allowed = false end
      else
        local elapsed = policy_now % period
        if last ~= nil then
          local start = policy_now - elapsed
          local stored_start = last - last % period
          if start == stored_start then
            used, prev = count, extra
          else
            same_windows = false
            if start == stored_start + period then prev = count end
          end
        end
        if floor((prev * (period - elapsed)) / period) + used + cost > limit then
          allowed = false
        end
      end
      views[base + 1], views[base + 2], views[base + 3], views[base + 4] = used, prev, limit,
        period
    end
  end
  policy[12] = allowed
  policy[13] = same_windows
  if policy[2] and not allowed then commit = false end
end

local reply = {0, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
local r = 1  -- the reply's last index
if replay then reply[1] = 3 end
for i = 1, n do
  local policy = policies[i]
  local algorithm, m, value, policy_now = policy[1], policy[3], policy[6], policy[8]
  local allowed, views = policy[12], policy
  local call_cost = policy[4]
  local cost = call_cost
  if peek then cost = 1 end
  local charged = commit and allowed and call_cost > 0
  local status = 0
  if charged then
    status = 1
  elseif replay then
    -- charged by the earlier evaluation when its ledger holds the id (cluster refunds)
    status = 2
    if remembers(value, policy[11], policy_now) then status = 1 end
  elseif allowed then
    status = 2
  end
  reply[r + 1] = status
  reply[r + 2] = policy_now
  r = r + 2
  -- Per window: a sliding log's four reported numbers (model._log_result); for the other
  -- algorithms the window's view (used, prev: model._view), from which the client
  -- computes the reported numbers (model.window_result). A charge needs the windows'
  -- time to live.
  local ttl = 0
  for w = 1, m do
    local base = 13 + 4 * (w - 1)
    local window_ttl = 0
    if algorithm == 4 then
      window_ttl = log_result(reply, r, KEYS[policy[9] + w - 1], views[base + 3],
        views[base + 4], views[base + 2], policy_now, cost, charged, replay)
      r = r + 4
    else
      local used, period = views[base + 1], views[base + 4]
      reply[r + 1] = used
      reply[r + 2] = views[base + 2]
      r = r + 2
      if charged then
        if algorithm == 1 then
          window_ttl = period - policy_now % period
        elseif algorithm == 3 then
          window_ttl = -floor(-(used + cost * period) / views[base + 3])
        else
          window_ttl = period - policy_now % period + period
        end
      end
    end
    if window_ttl > ttl then ttl = window_ttl end
  end
  if charged then
    -- The ledger with this evaluation appended (the oldest entry dropped when full), d,
    -- then the numbers.
    local ledger_end = policy[11]
    local entries = ledger_end - 1
    local kept = 2  -- byte of the oldest entry kept
    local dropped
    if value == '' then
      dropped = '\0\0\0\0\0\0'
    else
      dropped = sub(value, ledger_end + 1, ledger_end + 6)
      if entries >= LEDGER_SIZE * ENTRY then
        local b1, b2, b3, b4 = byte(value, 7, 10)  -- the oldest's charge time modulo 2^32
        local age = (policy_now - (((b1 * 256 + b2) * 256 + b3) * 256 + b4)) % STAMP
        if age < dedup_ttl then dropped = char(split48(policy_now - age + 1)) end
        kept = 2 + ENTRY
        entries = entries - ENTRY
      end
    end
    -- The numbers of each window (a, and b for the sliding window counter and the token
    -- bucket), as u48s; with one window they join t in a single char() call.
    local a, b, numbers
    for w = 1, m do
      local base = 13 + 4 * (w - 1)
      local period = views[base + 4]
      if algorithm == 3 then
        local deficit = views[base + 1] + call_cost * period
        a = floor(deficit / period)
        b = deficit - a * period
      elseif algorithm == 4 then
        local lv = views[base + 2]
        a = (lv.count + call_cost) % LOG_MODULUS
        log_charge(KEYS[policy[9] + w - 1], period, lv, policy_now)
      elseif algorithm == 2 then
        a, b = views[base + 1] + call_cost, views[base + 2]
      else
        a = views[base + 1] + call_cost
      end
      if m > 1 then
        if w == 1 then numbers = {} end
        numbers[w] = char(split48(a))
        if b then numbers[w] = numbers[w] .. char(split48(b)) end
      end
    end
    -- t as a u48; its low four bytes are the charge time modulo 2^32 (the entry's stamp)
    local t1, t2, t3, t4, t5, t6 = split48(policy_now)
    local head = char(entries / ENTRY + 1)
    local stamp = char(t3, t4, t5, t6)
    local stored
    if m > 1 then
      stored = head .. sub(value, kept, ledger_end) .. fingerprint .. stamp .. dropped
        .. char(t1, t2, t3, t4, t5, t6) .. table.concat(numbers)
    else
      local a1, a2, a3, a4, a5, a6 = split48(a)
      if b then
        stored = head .. sub(value, kept, ledger_end) .. fingerprint .. stamp .. dropped
          .. char(t1, t2, t3, t4, t5, t6, a1, a2, a3, a4, a5, a6, split48(b))
      else
        stored = head .. sub(value, kept, ledger_end) .. fingerprint .. stamp .. dropped
          .. char(t1, t2, t3, t4, t5, t6, a1, a2, a3, a4, a5, a6)
      end
    end
    if policy[13] and server_clock and policy_now == now and ttl >= dedup_ttl then
      -- The expiry set by the charge at t is late enough (model.keeps_expiry).
      redis.call('SET', KEYS[i], stored, 'KEEPTTL')
    else
      local lifetime = ttl + grace
      if lifetime < dedup_ttl then lifetime = dedup_ttl end
      redis.call('SET', KEYS[i], stored, 'PX', format('%d', lifetime))
    end
  end
end
return reply
