--[[ evaluate.lua: decide a group of policies atomically (django-quota; docs/arithmetic.md).

Mirrors django_quota/core/model.py function by function; the differential tests hold
the two to identical replies and identical stored state. Integer arithmetic only: every
product stays below 2^53 (the policy bounds guarantee it), every division goes through
floor_div, which corrects the rounding of the double quotient. No number is ever
formatted into a string (field names are built from small loop indexes only).

KEYS (1 per policy i = 1..n, in call order, then the sliding logs):
  KEYS[i]  the counter hash of (policy, revision, identity)
  then, for each sliding_log policy in call order, one list per window w = 1..m: the
  window's log (the counter key with l<w> before its "{": same hash tag, same slot)
ARGV:
  1  now, integer ms since the epoch; -1 = read Redis TIME (µs floored to ms)
  2  max clock regression, ms; -1 = clamp silently (server clock)
  3  mode: 0 = a fresh evaluation id; 1 = it may repeat an earlier one (search the
     ledgers first); 2 = peek (decide as cost 1 would and write nothing)
  4  the evaluation id's fingerprint (5 bytes; "" when peeking)
  5  DEDUP_TTL, ms: a charged counter lives at least this long; ledger entries younger
     than this are remembered, and dropping one makes a possible repeat indeterminate
  6  cleanup grace (CLEANUP_GRACE), ms
  7  n, the number of policies
  then per policy: cost (integer >= 0), algorithm (1 fixed_window, 2 sliding_window,
       3 token_bucket, 4 sliding_log), enforce (1 enforce, 0 shadow), window count m,
       then per window: limit, period (ms), capacity
Reply (integers only):
  { group status (0 decided, 1 clock unsafe, 2 indeterminate, 3 replayed),
    then per policy (only when 0 or 3): status (0 denied, 1 allowed and charged, now
                     or, when replayed, by the earlier evaluation; 2 allowed, not
                     charged), effective now (ms),
                     then per window: remaining, reset_after (ms),
                                      retry_after (ms, -1 unless this window denied),
                                      replenish_after (ms until remaining next rises) }
Writes: for each charged policy, one HSET (t, c<i>, p<i>, e, s, and d when the ledger
dropped a young entry) and one PEXPIRE; a sliding log also, per window: LPUSH of a new
event (none when its newest event is at now), LTRIM of the events that left (only when
some did; DEL instead when all did) and PEXPIRE (period + grace: until the unit just
recorded leaves). A denial, a peek and a replay write nothing.

State hash fields: t = last accepted now (ms); c<i>, p<i> per window i; the ledger of
the last 8 charged evaluations, oldest first: e = their 5-byte fingerprints, s = their
charge times modulo 2^32 ms (4 bytes big-endian each); d = charge time (ms) of the
newest entry dropped while younger than DEDUP_TTL (see model.py).

Sliding log (algorithm 4, docs/arithmetic.md): c<i> counts every unit window i ever
recorded, modulo LOG_MODULUS; its list holds, newest event first, two integers an event:
the now (ms) of an admission, then c<i> just before it. Admissions at one now share an
event. Reads per window: LLEN, LINDEX of the newest time, of the oldest time and of the
oldest inside's count; a binary search (LINDEX) only when some events have left, and
one more (over the counts) only when the window denies. So O(log L) commands, and O(1)
per charge whatever its cost.
]]

-- The ledger: 8 entries, kept in two fields so that each stays a small hash value
-- (under Redis's 64-byte hash-max-listpack-value): e = their 5-byte fingerprints,
-- s = their 4-byte charge times (modulo 2^32 ms, big-endian), oldest first.
local LEDGER_PRINTS = 40
local FINGERPRINT = 5
local STAMP_BYTES = 4
local STAMP = 4294967296
local LOG_MODULUS = 1000000000000  -- sliding-log counts wrap here (model.LOG_MODULUS)

local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function ceil_div(a, b)
  return -floor_div(-a, b)
end

local function mod(a, b)
  return a - floor_div(a, b) * b
end

local function sliding_estimate(prev, cur, elapsed, period)
  return floor_div(prev * (period - elapsed), period) + cur
end

local function sliding_wait(prev, cur, elapsed, period, target)
  local room = target - cur
  if room >= 0 then
    local needed = 0
    if prev ~= 0 then
      needed = period - floor_div((room + 1) * period - 1, prev)
    end
    if needed < 0 then needed = 0 end
    if needed < period then
      return math.max(1, needed - elapsed)
    end
  end
  local offset = 0
  if cur ~= 0 then
    offset = math.max(0, period - floor_div((target + 1) * period - 1, cur))
  end
  return math.max(1, period - elapsed + offset)
end

-- A sliding log seen at now (model._log_view): the units inside (now - period, now], held
-- by the `inside` newest events; the newest time and the oldest inside's (0 when
-- inside is 0); the events stored.
local function log_view(key, count, now, period)
  local size = redis.call('LLEN', key)
  local events = floor_div(size, 2)
  if events == 0 then return {used = 0, inside = 0, newest = 0, oldest = 0, events = 0} end
  local edge = now - period  -- a unit recorded at or before it has left
  local newest = tonumber(redis.call('LINDEX', key, 0))
  if newest <= edge then
    return {used = 0, inside = 0, newest = 0, oldest = 0, events = events}
  end
  local inside = events
  local oldest = tonumber(redis.call('LINDEX', key, 2 * events - 2))
  if oldest <= edge then
    local low, high = 1, events  -- low is inside, high is not
    oldest = newest
    while high - low > 1 do
      local middle = floor_div(low + high, 2)
      local time = tonumber(redis.call('LINDEX', key, 2 * middle - 2))
      if time > edge then
        low = middle
        oldest = time
      else
        high = middle
      end
    end
    inside = low
  end
  local used = mod(count - tonumber(redis.call('LINDEX', key, 2 * inside - 1)), LOG_MODULUS)
  return {used = used, inside = inside, newest = newest, oldest = oldest, events = events}
end

-- ms until cost fits in a window it does not fit now (model._log_wait): until the unit of
-- rank limit - cost + 1 (newest first) leaves, at its time + period.
local function log_wait(key, limit, period, lv, count, now, cost)
  if lv.inside == 0 then return period end
  local rank = math.max(1, limit - cost + 1)
  local low, high = 0, lv.inside  -- events 1..low hold fewer than rank units, 1..high enough
  while high - low > 1 do
    local middle = floor_div(low + high, 2)
    local before = tonumber(redis.call('LINDEX', key, 2 * middle - 1))
    if mod(count - before, LOG_MODULUS) >= rank then
      high = middle
    else
      low = middle
    end
  end
  return tonumber(redis.call('LINDEX', key, 2 * high - 2)) + period - now
end

-- Appends a sliding log window's numbers to out (model._log_result); returns the ttl.
local function log_result(out, key, limit, period, lv, count, now, cost, charged, replay)
  local counted, reset_after, replenish
  if charged then
    counted = lv.used + cost
    reset_after = period
    replenish = period
    if lv.inside > 0 then replenish = lv.oldest + period - now end
  else
    counted = lv.used
    reset_after = 0
    replenish = 0
    if lv.inside > 0 then
      reset_after = lv.newest + period - now
      replenish = lv.oldest + period - now
    end
  end
  local retry_after = -1
  if lv.used + cost > limit then
    retry_after = log_wait(key, limit, period, lv, count, now, cost)
  end
  if replay then retry_after = -1 end
  local remaining = 0
  if counted < limit then remaining = limit - counted end
  local size = #out
  out[size + 1] = remaining
  out[size + 2] = reset_after
  out[size + 3] = retry_after
  out[size + 4] = replenish
  return reset_after
end

-- Records a charge at now in a sliding log (model._charged_log): a new newest event
-- (time, count before it) unless the newest is at now; drops the events that left.
local function log_charge(key, period, lv, count, now, grace)
  if lv.inside > 0 and lv.newest == now then
    if lv.inside < lv.events then redis.call('LTRIM', key, 0, 2 * lv.inside - 1) end
  else
    if lv.inside == 0 and lv.events ~= 0 then redis.call('DEL', key) end
    redis.call('LPUSH', key, count, now)
    if lv.inside > 0 and lv.inside < lv.events then
      redis.call('LTRIM', key, 0, 2 * lv.inside + 1)
    end
  end
  redis.call('PEXPIRE', key, period + grace)
end

-- The window's state seen at now: used (fixed count, sliding cur, bucket deficit), prev.
local function view(algorithm, limit, period, last, count, extra, now)
  if last == nil then return 0, 0 end
  count = count or 0
  if algorithm == 1 then
    if now - mod(now, period) == last - mod(last, period) then return count, 0 end
    return 0, 0
  end
  extra = extra or 0
  if algorithm == 3 then
    local deficit = count * period + extra
    local elapsed = now - last
    if elapsed >= ceil_div(deficit, limit) then return 0, 0 end
    return deficit - elapsed * limit, 0
  end
  local start = now - mod(now, period)
  local stored_start = last - mod(last, period)
  if start == stored_start then return count, extra end
  if start == stored_start + period then return 0, count end
  return 0, 0
end

local function allows(algorithm, limit, period, capacity, used, prev, now, cost)
  if algorithm == 1 then
    return used + cost <= limit
  end
  if algorithm == 4 then
    return used + cost <= limit
  end
  if algorithm == 3 then
    return used + cost * period <= capacity * period
  end
  return sliding_estimate(prev, used, mod(now, period), period) + cost <= limit
end

-- Appends remaining, reset_after, retry_after, replenish_after to out; returns the ttl.
local function window_result(out, algorithm, limit, period, capacity, used, prev, now, cost,
    charged, replay)
  local remaining, reset_after, retry_after, replenish, ttl
  if algorithm == 1 then
    reset_after = period - mod(now, period)
    local count = used
    if charged then count = used + cost end
    retry_after = -1
    if used + cost > limit then retry_after = reset_after end
    remaining = 0
    if count < limit then remaining = limit - count end
    replenish = reset_after
    ttl = reset_after
  elseif algorithm == 3 then
    local capacity_scaled = capacity * period
    local deficit = used
    if charged then deficit = used + cost * period end
    remaining = floor_div(capacity_scaled - deficit, period)
    reset_after = ceil_div(deficit, limit)
    retry_after = -1
    if used + cost * period > capacity_scaled then
      retry_after = ceil_div(used + cost * period - capacity_scaled, limit)
    end
    replenish = 0
    if remaining < capacity then
      replenish = ceil_div(deficit - (capacity_scaled - (remaining + 1) * period), limit)
    end
    ttl = reset_after
  else
    local elapsed = mod(now, period)
    reset_after = period - elapsed
    local cur = used
    local estimate = sliding_estimate(prev, used, elapsed, period)
    local counted = estimate
    if charged then
      cur = used + cost
      counted = estimate + cost
    end
    retry_after = -1
    if estimate + cost > limit then
      retry_after = sliding_wait(prev, used, elapsed, period, limit - cost)
    end
    replenish = 0
    if counted ~= 0 then
      replenish = sliding_wait(prev, cur, elapsed, period, counted - 1)
    end
    remaining = 0
    if counted < limit then remaining = limit - counted end
    ttl = reset_after + period
  end
  if replay then retry_after = -1 end
  local size = #out
  out[size + 1] = remaining
  out[size + 2] = reset_after
  out[size + 3] = retry_after
  out[size + 4] = replenish
  return ttl
end

-- Milliseconds since the ledger entry whose charge time starts at byte start of s was
-- charged (modulo 2^32).
local function stamp_age(stamps, start, now)
  local b1, b2, b3, b4 = string.byte(stamps, start, start + STAMP_BYTES - 1)
  local at = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
  return mod(now - at, STAMP)
end

-- 4 big-endian bytes of now modulo 2^32 (binary, not decimal: nothing is formatted).
local function stamp(now)
  local x = mod(now, STAMP)
  local b1 = floor_div(x, 16777216)
  x = x - b1 * 16777216
  local b2 = floor_div(x, 65536)
  x = x - b2 * 65536
  local b3 = floor_div(x, 256)
  return string.char(b1, b2, b3, x - b3 * 256)
end

local function remembers(prints, stamps, fingerprint, now, dedup_ttl)
  if not prints then return false end
  local entries = #prints / FINGERPRINT
  for i = 0, entries - 1 do
    if string.sub(prints, FINGERPRINT * i + 1, FINGERPRINT * (i + 1)) == fingerprint
        and stamp_age(stamps, STAMP_BYTES * i + 1, now) < dedup_ttl then
      return true
    end
  end
  return false
end

local now = tonumber(ARGV[1])
if now < 0 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + floor_div(tonumber(time[2]), 1000)
end
local max_regression = tonumber(ARGV[2])
local mode = tonumber(ARGV[3])
local peek = mode == 2
local fingerprint = ARGV[4]
local dedup_ttl = tonumber(ARGV[5])
local grace = tonumber(ARGV[6])
local n = tonumber(ARGV[7])

-- Read every counter: t, d, e, s, then c<w>, p<w> per window, in one HMGET each.
local calls = {}
local position = 8
local log_position = n + 1  -- KEYS index of the next sliding log
for i = 1, n do
  local m = tonumber(ARGV[position + 3])
  local call = {
    cost = tonumber(ARGV[position]),
    algorithm = tonumber(ARGV[position + 1]),
    enforce = tonumber(ARGV[position + 2]) == 1,
    m = m,
    first = position + 4,
  }
  position = position + 4 + 3 * m
  if call.algorithm == 4 then
    call.logs = log_position
    log_position = log_position + m
  end
  local names = {'t', 'd', 'e', 's'}
  for w = 1, m do
    names[2 * w + 3] = 'c' .. w
    names[2 * w + 4] = 'p' .. w
  end
  local stored = redis.call('HMGET', KEYS[i], unpack(names))
  call.last = tonumber(stored[1])
  call.dropped = tonumber(stored[2])
  call.prints = stored[3]
  call.stamps = stored[4]
  call.stored = stored
  local effective = now
  if call.last ~= nil and now < call.last then
    if max_regression >= 0 and call.last - now > max_regression then
      return {1}
    end
    effective = call.last
  end
  call.now = effective
  calls[i] = call
end

local replay = false
if mode == 1 then
  for i = 1, n do
    if remembers(calls[i].prints, calls[i].stamps, fingerprint, calls[i].now, dedup_ttl) then
      replay = true
      break
    end
  end
  if not replay then
    for i = 1, n do
      local call = calls[i]
      if call.dropped ~= nil and call.now - call.dropped < dedup_ttl then
        return {2}
      end
    end
  end
end

local commit = not peek and not replay
for i = 1, n do
  local call = calls[i]
  local cost = call.cost
  if peek then cost = 1 end
  call.allows = true
  call.views = {}
  local p = call.first
  for w = 1, call.m do
    local limit, period = tonumber(ARGV[p]), tonumber(ARGV[p + 1])
    local used, prev
    if call.algorithm == 4 then
      local count = tonumber(call.stored[2 * w + 3]) or 0
      local lv = {used = 0, inside = 0, newest = 0, oldest = 0, events = -1}
      if call.last ~= nil then  -- no numbers: whatever a list holds is not this counter's
        lv = log_view(KEYS[call.logs + w - 1], count, call.now, period)
      end
      lv.count = count
      used, prev = lv.used, 0
      call.views[w] = {used, prev, lv}
    else
      used, prev = view(call.algorithm, limit, period, call.last,
        tonumber(call.stored[2 * w + 3]), tonumber(call.stored[2 * w + 4]), call.now)
      call.views[w] = {used, prev}
    end
    if not allows(call.algorithm, limit, period, tonumber(ARGV[p + 2]), used, prev,
        call.now, cost) then
      call.allows = false
    end
    p = p + 3
  end
  if call.enforce and not call.allows then commit = false end
end

local reply = {0}
if replay then reply[1] = 3 end
for i = 1, n do
  local call = calls[i]
  local cost = call.cost
  if peek then cost = 1 end
  local charged = commit and call.allows and call.cost > 0
  local status = 0
  if charged then
    status = 1
  elseif replay then
    -- charged by the earlier evaluation when its ledger holds the id (cluster refunds)
    status = 2
    if remembers(call.prints, call.stamps, fingerprint, call.now, dedup_ttl) then
      status = 1
    end
  elseif call.allows then
    status = 2
  end
  reply[#reply + 1] = status
  reply[#reply + 1] = call.now
  local ttl = 0
  local p = call.first
  for w = 1, call.m do
    local v = call.views[w]
    local window_ttl
    if call.algorithm == 4 then
      window_ttl = log_result(reply, KEYS[call.logs + w - 1], tonumber(ARGV[p]),
        tonumber(ARGV[p + 1]), v[3], v[3].count, call.now, cost, charged, replay)
    else
      window_ttl = window_result(reply, call.algorithm, tonumber(ARGV[p]),
        tonumber(ARGV[p + 1]), tonumber(ARGV[p + 2]), v[1], v[2], call.now, cost, charged,
        replay)
    end
    if window_ttl > ttl then ttl = window_ttl end
    p = p + 3
  end
  if charged then
    local prints = call.prints or ''
    local stamps = call.stamps or ''
    local fields = {'t', call.now}
    if #prints >= LEDGER_PRINTS then
      local age = stamp_age(stamps, 1, call.now)
      if age < dedup_ttl then
        fields[3] = 'd'
        fields[4] = call.now - age
      end
      prints = string.sub(prints, FINGERPRINT + 1)
      stamps = string.sub(stamps, STAMP_BYTES + 1)
    end
    fields[#fields + 1] = 'e'
    fields[#fields + 1] = prints .. fingerprint
    fields[#fields + 1] = 's'
    fields[#fields + 1] = stamps .. stamp(call.now)
    p = call.first
    for w = 1, call.m do
      local v = call.views[w]
      local period = tonumber(ARGV[p + 1])
      if call.algorithm == 3 then
        local deficit = v[1] + call.cost * period
        local whole = floor_div(deficit, period)
        fields[#fields + 1] = 'c' .. w
        fields[#fields + 1] = whole
        fields[#fields + 1] = 'p' .. w
        fields[#fields + 1] = deficit - whole * period
      elseif call.algorithm == 4 then
        local lv = v[3]
        fields[#fields + 1] = 'c' .. w
        fields[#fields + 1] = mod(lv.count + call.cost, LOG_MODULUS)
        log_charge(KEYS[call.logs + w - 1], period, lv, lv.count, call.now, grace)
      else
        fields[#fields + 1] = 'c' .. w
        fields[#fields + 1] = v[1] + call.cost
        if call.algorithm == 2 then
          fields[#fields + 1] = 'p' .. w
          fields[#fields + 1] = v[2]
        end
      end
      p = p + 3
    end
    redis.call('HSET', KEYS[i], unpack(fields))
    local lifetime = ttl + grace
    if lifetime < dedup_ttl then lifetime = dedup_ttl end
    redis.call('PEXPIRE', KEYS[i], lifetime)
  end
end
return reply
