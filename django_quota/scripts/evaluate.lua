--[[ evaluate.lua: decide a group of policies atomically (django-quota, contract 5).

Mirrors django_quota/core/model.py function by function; the differential tests hold
the two to identical replies. Integer arithmetic only: every product stays below 2^53
(the policy bounds guarantee it), every division goes through floor_div, which corrects
the rounding of the double quotient. No number is ever formatted into a string.

KEYS (2 per policy i = 1..n, in call order):
  KEYS[2i-1]  the counter hash of (policy, revision, identity)
  KEYS[2i]    the evaluation-id record of this call for that counter (a list)
ARGV:
  1  now, integer ms since the epoch; -1 = read Redis TIME (µs floored to ms)
  2  max clock regression, ms; -1 = clamp silently (server clock)
  3  peek: 1 = decide as cost 1 would and write nothing; 0 = evaluate
  4  evaluation-id record lifetime (DEDUP_TTL), ms
  5  cleanup grace (CLEANUP_GRACE), ms
  6  n, the number of policies
  then per policy: algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket),
       enforce (1 enforce, 0 shadow), cost (integer >= 0), window count m,
       then per window: limit, period (ms), capacity
Reply (integers only):
  { clock_unsafe (0|1), replayed (0|1),
    then per policy: status (0 denied, 1 allowed and charged, 2 allowed, not charged),
                     effective now (ms),
                     then per window: remaining, reset_after (ms),
                                      retry_after (ms, -1 unless this window denied),
                                      replenish_after (ms until remaining next rises) }
  clock_unsafe = 1 returns {1, 0} and writes nothing.

State hash fields: t = last accepted now (ms); c<i>, p<i> per window i (see model.py).
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

-- The window's state seen at now: used (fixed count, sliding cur, bucket deficit), prev.
local function view(algorithm, limit, period, index, state, now)
  local last = state['t']
  if last == nil then return 0, 0 end
  local count = state['c' .. index] or 0
  local extra = state['p' .. index] or 0
  if algorithm == 3 then
    local deficit = count * period + extra
    local elapsed = now - last
    if elapsed >= ceil_div(deficit, limit) then return 0, 0 end
    return deficit - elapsed * limit, 0
  end
  local start = now - mod(now, period)
  local stored_start = last - mod(last, period)
  if algorithm == 1 then
    if start == stored_start then return count, 0 end
    return 0, 0
  end
  if start == stored_start then return count, extra end
  if start == stored_start + period then return 0, count end
  return 0, 0
end

local function allows(algorithm, limit, period, capacity, used, prev, now, cost)
  if algorithm == 3 then
    return used + cost * period <= capacity * period
  end
  if algorithm == 1 then
    return used + cost <= limit
  end
  return sliding_estimate(prev, used, mod(now, period), period) + cost <= limit
end

-- Appends remaining, reset_after, retry_after, replenish_after to out; returns the ttl.
local function window_result(out, algorithm, limit, period, capacity, used, prev, now, cost, charged)
  if algorithm == 3 then
    local capacity_scaled = capacity * period
    local deficit = used
    if charged then deficit = used + cost * period end
    local remaining = floor_div(capacity_scaled - deficit, period)
    local reset_after = ceil_div(deficit, limit)
    local retry_after = -1
    if used + cost * period > capacity_scaled then
      retry_after = ceil_div(used + cost * period - capacity_scaled, limit)
    end
    local replenish = 0
    if remaining < capacity then
      replenish = ceil_div(deficit - (capacity_scaled - (remaining + 1) * period), limit)
    end
    out[#out + 1] = remaining
    out[#out + 1] = reset_after
    out[#out + 1] = retry_after
    out[#out + 1] = replenish
    return reset_after
  end
  local start = now - mod(now, period)
  local elapsed = now - start
  local reset_after = start + period - now
  if algorithm == 1 then
    local count = used
    if charged then count = used + cost end
    local retry_after = -1
    if used + cost > limit then retry_after = reset_after end
    out[#out + 1] = math.max(0, limit - count)
    out[#out + 1] = reset_after
    out[#out + 1] = retry_after
    out[#out + 1] = reset_after
    return reset_after
  end
  local cur = used
  local estimate = sliding_estimate(prev, used, elapsed, period)
  local counted = estimate
  if charged then
    cur = used + cost
    counted = estimate + cost
  end
  local retry_after = -1
  if estimate + cost > limit then
    retry_after = sliding_wait(prev, used, elapsed, period, limit - cost)
  end
  local replenish = 0
  if counted ~= 0 then
    replenish = sliding_wait(prev, cur, elapsed, period, counted - 1)
  end
  out[#out + 1] = math.max(0, limit - counted)
  out[#out + 1] = reset_after
  out[#out + 1] = retry_after
  out[#out + 1] = replenish
  return reset_after + period
end

local now = tonumber(ARGV[1])
if now < 0 then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + floor_div(tonumber(time[2]), 1000)
end
local max_regression = tonumber(ARGV[2])
local peek = tonumber(ARGV[3]) == 1
local dedup_ttl = tonumber(ARGV[4])
local grace = tonumber(ARGV[5])
local n = tonumber(ARGV[6])

-- A repeated evaluation id returns the stored replies and consumes nothing.
if not peek then
  local stored = {}
  for i = 1, n do
    local record = redis.call('LRANGE', KEYS[2 * i], 0, -1)
    if #record == 0 then
      stored = nil
      break
    end
    stored[i] = record
  end
  if stored ~= nil then
    local reply = {0, 1}
    for i = 1, n do
      for _, value in ipairs(stored[i]) do
        reply[#reply + 1] = tonumber(value)
      end
    end
    return reply
  end
end

local calls = {}
local position = 7
for i = 1, n do
  local call = {
    algorithm = tonumber(ARGV[position]),
    enforce = tonumber(ARGV[position + 1]) == 1,
    cost = tonumber(ARGV[position + 2]),
    windows = {},
  }
  local m = tonumber(ARGV[position + 3])
  position = position + 4
  for w = 1, m do
    call.windows[w] = {
      limit = tonumber(ARGV[position]),
      period = tonumber(ARGV[position + 1]),
      capacity = tonumber(ARGV[position + 2]),
    }
    position = position + 3
  end
  local flat = redis.call('HGETALL', KEYS[2 * i - 1])
  local state = {}
  for f = 1, #flat, 2 do
    state[flat[f]] = tonumber(flat[f + 1])
  end
  call.state = state
  local effective = now
  if state['t'] ~= nil and now < state['t'] then
    if max_regression >= 0 and state['t'] - now > max_regression then
      return {1, 0}
    end
    effective = state['t']
  end
  call.now = effective
  calls[i] = call
end

local commit = not peek
for i = 1, n do
  local call = calls[i]
  local cost = call.cost
  if peek then cost = 1 end
  call.allows = true
  call.views = {}
  for w, window in ipairs(call.windows) do
    local used, prev = view(call.algorithm, window.limit, window.period, w, call.state, call.now)
    call.views[w] = {used, prev}
    if not allows(call.algorithm, window.limit, window.period, window.capacity, used, prev,
        call.now, cost) then
      call.allows = false
    end
  end
  if call.enforce and not call.allows then commit = false end
end

local reply = {0, 0}
for i = 1, n do
  local call = calls[i]
  local cost = call.cost
  if peek then cost = 1 end
  local charged = commit and call.allows and call.cost > 0
  local out = {}
  if charged then
    out[1] = 1
  elseif call.allows then
    out[1] = 2
  else
    out[1] = 0
  end
  out[2] = call.now
  local ttl = 0
  for w, window in ipairs(call.windows) do
    local v = call.views[w]
    local window_ttl = window_result(out, call.algorithm, window.limit, window.period,
      window.capacity, v[1], v[2], call.now, cost, charged)
    if window_ttl > ttl then ttl = window_ttl end
  end
  if charged then
    local fields = {'t', call.now}
    for w, window in ipairs(call.windows) do
      local v = call.views[w]
      if call.algorithm == 3 then
        local deficit = v[1] + call.cost * window.period
        local whole = floor_div(deficit, window.period)
        fields[#fields + 1] = 'c' .. w
        fields[#fields + 1] = whole
        fields[#fields + 1] = 'p' .. w
        fields[#fields + 1] = deficit - whole * window.period
      else
        fields[#fields + 1] = 'c' .. w
        fields[#fields + 1] = v[1] + call.cost
        if call.algorithm == 2 then
          fields[#fields + 1] = 'p' .. w
          fields[#fields + 1] = v[2]
        end
      end
    end
    redis.call('HSET', KEYS[2 * i - 1], unpack(fields))
    redis.call('PEXPIRE', KEYS[2 * i - 1], ttl + grace)
  end
  if not peek then
    redis.call('RPUSH', KEYS[2 * i], unpack(out))
    redis.call('PEXPIRE', KEYS[2 * i], dedup_ttl)
  end
  for _, value in ipairs(out) do
    reply[#reply + 1] = value
  end
end
return reply
