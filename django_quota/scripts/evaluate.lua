--[[ evaluate.lua: decide a group of policies atomically (django-quota; docs/arithmetic.md).

Mirrors django_quota/core/model.py function by function; the differential tests hold
the two to identical replies and identical stored state. Integer arithmetic only, in
doubles: every operand and product stays below 2^53 in magnitude (the policy bounds
guarantee it), so floor(a / b) is the exact integer quotient (the rounding error of
a / b is below 1 / b, the least distance from a non-integer quotient to an integer) and
a % b, which Lua computes as a - floor(a / b) * b, the exact remainder, non-negative
for b > 0 (docs/arithmetic.md).

Cost: the script runs on every decision, so it avoids what Redis's Lua makes expensive
(measured in instructions per call, docs/benchmarks.md): every VM instruction (about 50
machine instructions each) and C call, tonumber() on a decimal string (two strtod; the
arithmetic coerces a string with one, so x + 0 instead), a Lua number passed to
redis.call or concatenated (formatted through "%.17g"), a closure or table made or grown
per call, every integer of the reply and every extra command. Hence
binary arguments read in as few string.byte calls as possible, a binary counter value
(one GET and one SET with its expiry per charged counter), each policy decided in the
pass that reads it, and a reply without what the client can derive.

KEYS (1 per policy i = 1..n, in call order, then the sliding logs):
  KEYS[i]  the counter of (policy, revision, identity): a string (layout below); for a
           concurrency policy its leases' sorted set instead (below)
  then, for each sliding_log policy in call order, one list per window w = 1..m: the
  window's log (the counter key with l<w> before its "{": same hash tag, same slot)
ARGV:
  1  the head of the ledger entry a charge appends (core/evaluation_ids.py): the
     evaluation id's fingerprint (5 bytes, its first bit 0), or, when the group's cost is
     not 1, that fingerprint with its first bit set, then the cost (u48); "" when peeking
  2  every number, packed (core/protocol.py packs it): unsigned big-endian integers,
     "u8" one byte, "u16" two, "u64" eight (every value below 2^48, so the script
     reads only the low six bytes)
       u8 mode: 0 = a fresh evaluation id; 1 = it may repeat an earlier one (search the
                ledgers first); 2 = peek (decide as cost 1 would and write nothing); plus
                4 when the client gives now (else the script reads Redis TIME)
       u16 n, the number of policies
       u64 now + 1, integer ms since the epoch (0 when mode has no 4: Redis TIME, µs
           floored to ms)
       u64 max clock regression + 1, ms; 0 = clamp silently (server clock)
       u64 DEDUP_TTL, ms: a charged counter lives at least this long; ledger entries
           younger than this are remembered, and dropping one makes a possible repeat
           indeterminate
       u64 cleanup grace (CLEANUP_GRACE), ms
     then per policy: u8 algorithm (1 fixed_window, 2 sliding_window, 3 token_bucket,
       4 sliding_log, 5 fixed_window with calendar windows, 6 concurrency), u8 enforce
       (1 enforce, 0 shadow), u16 window count m, u64 cost,
       then per window: u64 limit, u64 period (ms), u64 capacity; for algorithm 5
       instead u64 limit, u64 b1, u64 b0, u64 b2 (ms): the boundaries of the window's
       local calendar windows around the client's now (core/calendar.py), or u64 limit,
       u64 period, 0, 0 for an epoch-aligned window of the policy; the window is
       [b0, b1) or [b1, b2), whichever holds now, and the group is clock unsafe (1) when
       neither does (model._places, docs/policies.md)
Reply (integers only):
  { group status (0 decided, 1 clock unsafe, 2 indeterminate, 3 replayed),
    then per policy (only when 0 or 3): its status, only when replayed (1 charged by the
                     earlier evaluation, 2 not; a decided group's statuses follow from the
                     views, and the client derives them as model.evaluate_group decides),
                     its effective now (ms),
                     then per window of a fixed window or token bucket: its view before
                       this call (model._view) used (the fixed count, the bucket's scaled
                       deficit); of a sliding window counter: used (its current count) and
                       prev (its previous count); from the view the client computes the
                       reported numbers with the model's own arithmetic
                       (model.window_result: every one follows from the view, now, the
                       window and the cost);
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

Concurrency (algorithm 6, one window "N/P", docs/concurrency.md): KEYS[i] is a sorted
set, one member per held lease: the 5-byte fingerprint of the evaluation that acquired
it, then its units (u16), scored by its expiry (ms). Read with one ZRANGE; its view
replied as a sliding window counter's two integers: the units held at now (leases
expiring after now) and the ms until the oldest of them expires (0: none). An acquire:
ZREMRANGEBYSCORE of the expired leases (when some are), ZADD, PEXPIRE (until the latest
lease expires, plus the grace). A repeat (mode 1) finds its own lease. release.lua frees
a lease.

Counter value (core/protocol.py decodes it; "u48" = 6 bytes big-endian):
  u8 L, the ledger's length in bytes (0, or 9 to 72), then its entries, oldest first: the
     5-byte fingerprint of a charged evaluation, its cost (u48) when that is not 1 (then
     the fingerprint's first bit is set), then its charge time modulo 2^32 ms (4 bytes);
     so 9 bytes, or 15 with a cost. A charge appends its entry and drops the oldest
     while the ledger is over 72 bytes: it keeps the last 8 charges of cost 1, at least
     the last 4 whatever their costs;
  u48 d + 1: d = charge time (ms) of the newest entry dropped while younger than
     DEDUP_TTL (0: none; see model.py);
  then, unless the numbers were reset: u48 t (the last accepted now, ms), and per window
     u48 c<w>, followed, for the sliding window counter and the token bucket, by u48 p<w>.
  Another type at the key (a hash of an earlier version), or a string in the layout of
  an earlier version (u8 k, the entry count, then k 9-byte entries without costs), reads
  as no counter, and the first charge replaces it.

Sliding log (algorithm 4, docs/arithmetic.md): c<i> counts every unit window i ever
recorded, modulo LOG_MODULUS; its list holds, newest event first, two integers an event:
the now (ms) of an admission, then c<i> just before it. Admissions at one now share an
event. Reads per window: LINDEX of the newest time, then LRANGE of the oldest event (its
time and the count before it); when every event is inside, nothing more (LLEN only when
the window denies, for the binary search over the counts that finds its wait); when some
have left, LLEN, a binary search (LINDEX) for the oldest inside and the LINDEX of its
count. So O(log L) commands, and O(1) per charge whatever its cost; an allowed charge
with nothing left is LINDEX, LRANGE, LPUSH and PEXPIRE.

Shapes (django_quota/scripts/shapes.py, docs/architecture.md#the-script-protocol): this
file is the general script, run as it is for any group. The common call, one policy with
one window, runs a variant generated from this file per algorithm (evaluate_fixed_window,
evaluate_sliding_window, evaluate_token_bucket, evaluate_sliding_log): the same KEYS,
ARGV, reply and writes, without the loops over policies and windows, the dispatch on the
algorithm and the other algorithms' code. The generator reads three kinds of comment: a
line "--@ if EXPR" (then "--@ elif EXPR", "--@ else", "--@ end") keeps the lines up to the
next one only in the scripts where EXPR holds; "--@ EXPR" ending a line of code keeps that
line only there; a line "--+ code" is code of the variants only (a comment here). EXPR is
names joined by "or": general (this script) or an algorithm (true here, and in its own
variant).
]]

local byte, char, sub, format = string.byte, string.char, string.sub, string.format
local floor = math.floor  --@ general or sliding_window or token_bucket or sliding_log
local max = math.max  --@ sliding_log

local LEDGER_BYTES = 72  -- the ledger's bound (8 entries of cost 1)
local ENTRY = 9  -- bytes of a ledger entry of cost 1: 5 of fingerprint, 4 of charge time
local STAMP = 4294967296
local LOG_MODULUS = 1000000000000  -- sliding-log counts wrap here (model.LOG_MODULUS)  --@ sliding_log

--@ if general
-- The six bytes of x (0 <= x < 2^48), most significant first: remainders and exact
-- divisions by 256, no C call (char(split48(x)) is x as a u48). For the windows of a
-- charge with more than one; elsewhere written out, as a closure is made on every call.
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
--@ end

local head, packed = ARGV[1], ARGV[2]
-- The fingerprint alone (a concurrency lease's member): the head less any cost, made
-- where a concurrency policy is read.
local fingerprint = head  --@ general

-- The header in one call (a C call costs more than the numbers it returns): mode, n, then
-- the low six bytes of now + 1, max regression + 1, DEDUP_TTL and the grace (a variant
-- reads its one policy and window in the same call).
local mode, n_high, n_low, _, _, h1, h2, h3, h4, h5, h6, _, _, r1, r2, r3, r4, r5, r6,
  _, _, e1, e2, e3, e4, e5, e6, _, _, g1, g2, g3, g4, g5, g6 = byte(packed, 1, 35)  --@ general
  --+ _, _, e1, e2, e3, e4, e5, e6, _, _, g1, g2, g3, g4, g5, g6,
  --+ algorithm, enforce, m_high, m_low, _, _, c1, c2, c3, c4, c5, c6,
  --+ _, _, l1, l2, l3, l4, l5, l6, _, _, p1, p2, p3, p4, p5, p6 = byte(packed, 1, 63)  --@ fixed_window or sliding_window or sliding_log
  --+ _, _, l1, l2, l3, l4, l5, l6, _, _, p1, p2, p3, p4, p5, p6, _, _, q1, q2, q3, q4, q5, q6 =  --@ token_bucket
    --+ byte(packed, 1, 71)  --@ token_bucket
local n = n_high * 256 + n_low  --@ general
local now = -1
if mode >= 4 then  -- the client's clock
  mode = mode - 4
  now = ((((h1 * 256 + h2) * 256 + h3) * 256 + h4) * 256 + h5) * 256 + h6 - 1
end
local peek = mode == 2
-- Whether now is on the clock expiries follow (Redis TIME): only then may a charge keep
-- its counter's expiry (model.keeps_expiry).
local server_clock = now < 0
if server_clock then
  -- Redis TIME in ms: seconds * 1000 plus the µs / 1000 floored. Its two decimal strings
  -- are made numbers by the arithmetic (Lua's coercion: one strtod each, exact; cheaper
  -- than their digits' arithmetic), and x - x % 1 is floor(x) exactly (docs/arithmetic.md).
  local time = redis.call('TIME')
  local ms = time[2] / 1000
  now = time[1] * 1000 + (ms - ms % 1)
end
-- DEDUP_TTL matters when something may be charged or searched for; the grace (g1..g6) is
-- read where a lifetime is set.
local dedup_ttl = 0
if not peek then
  dedup_ttl = ((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6
end

--@ if sliding_log
-- The sliding log's functions (model._log_view, _log_wait, _log_result, _charged_log),
-- made only for a group that has one (its lists' keys follow the counters in KEYS).
local log_view, log_result, log_charge
if #KEYS > n then  -- the sliding logs' lists follow the counters  --@ general
  local function decimal(x)  -- an integer as redis.call takes it, without "%.17g"
    return format('%d', x)
  end

  -- The units inside (now - period, now], held by the `inside` newest events; the newest
  -- time and the oldest inside's (0 when inside is 0); the events stored. all: every
  -- event is inside (then inside and events are not read: 0).
  log_view = function(key, count, at_now, period)
    local newest = redis.call('LINDEX', key, '0')
    if not newest then return {used = 0, inside = 0, newest = 0, oldest = 0, events = 0} end
    newest = newest + 0
    local edge = at_now - period  -- a unit recorded at or before it has left
    if newest <= edge then  -- events, none inside
      return {used = 0, inside = 0, newest = 0, oldest = 0, events = 1}
    end
    local pair = redis.call('LRANGE', key, '-2', '-1')  -- the oldest event: time, count before
    local oldest = pair[1] + 0
    if oldest > edge then
      -- Every event is inside: how many is read only when a denial's wait needs it.
      return {used = (count - pair[2]) % LOG_MODULUS, all = true, inside = 0,
        newest = newest, oldest = oldest, events = 0}
    end
    local events = floor(redis.call('LLEN', key) / 2)
    local low, high = 1, events  -- low is inside, high is not
    oldest = newest
    while high - low > 1 do
      local middle = floor((low + high) / 2)
      local time = redis.call('LINDEX', key, decimal(2 * middle - 2)) + 0
      if time > edge then
        low = middle
        oldest = time
      else
        high = middle
      end
    end
    local before = redis.call('LINDEX', key, decimal(2 * low - 1)) + 0
    return {used = (count - before) % LOG_MODULUS, inside = low, newest = newest,
      oldest = oldest, events = events}
  end

  -- ms until cost fits in a window it does not fit now: until the unit of rank
  -- limit - cost + 1 (newest first) leaves, at its time + period.
  local function log_wait(key, limit, period, lv, at_now, cost)
    local inside = lv.inside
    if lv.all then inside = floor(redis.call('LLEN', key) / 2) end
    if inside == 0 then return period end
    local rank = max(1, limit - cost + 1)
    local low, high = 0, inside  -- events 1..low hold fewer than rank units, 1..high enough
    while high - low > 1 do
      local middle = floor((low + high) / 2)
      local before = redis.call('LINDEX', key, decimal(2 * middle - 1)) + 0
      if (lv.count - before) % LOG_MODULUS >= rank then
        high = middle
      else
        low = middle
      end
    end
    return redis.call('LINDEX', key, decimal(2 * high - 2)) + period - at_now
  end

  -- Sets out[at + 1 .. at + 4] to the window's numbers; returns the ttl.
  log_result = function(out, at, key, limit, period, lv, at_now, cost, charged, replayed)
    local counted, reset_after, replenish
    if charged then
      counted = lv.used + cost
      reset_after = period
      replenish = period
      if lv.all or lv.inside > 0 then replenish = lv.oldest + period - at_now end
    else
      counted = lv.used
      reset_after = 0
      replenish = 0
      if lv.all or lv.inside > 0 then
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
    if lv.all then  -- nothing has left: nothing to trim
      if lv.newest ~= at_now then redis.call('LPUSH', key, decimal(lv.count), decimal(at_now)) end
    elseif lv.inside > 0 and lv.newest == at_now then
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
    local grace = ((((g1 * 256 + g2) * 256 + g3) * 256 + g4) * 256 + g5) * 256 + g6
    redis.call('PEXPIRE', key, decimal(period + grace))
  end
end  --@ general
--@ end

-- Each policy is read and decided in one pass; what the reply and the writes need is kept
-- in one array per policy: 1 algorithm, 2 window count, 3 cost, 4 its counter value (''
-- for none), 5 the effective now, 6 KEYS index of its first log, 7 byte of the ledger's
-- end (the byte before d), 8 allowed, 9 whether every window is the stored t's, and
-- from 10 the windows' views, 4 values each: used, prev (a sliding log's view table
-- instead), limit, period. (A variant keeps them in its locals.)
local policies = {nil, nil}  -- nil slots make room ahead (a table grown rehashes)  --@ general
local offset = 36  --@ general
local log_index = n + 1  -- KEYS index of the next sliding log  --@ general
local commit = not peek
for i = 1, n do  --@ general
--+ local i = 1
  -- The policy and its first window in one call.  --@ general
  local algorithm, enforce, m_high, m_low, _, _, c1, c2, c3, c4, c5, c6,  --@ general
    _, _, l1, l2, l3, l4, l5, l6, _, _, p1, p2, p3, p4, p5, p6, _, _, q1, q2, q3, q4, q5, q6 =  --@ general
    byte(packed, offset, offset + 35)  --@ general
  local m = m_high * 256 + m_low  --@ general
  local call_cost = ((((c1 * 256 + c2) * 256 + c3) * 256 + c4) * 256 + c5) * 256 + c6
  local first = offset + 12  --@ general
  local width = 24  --@ general
  if algorithm == 5 then width = 32 end  -- a calendar call's windows  --@ general
  offset = first + width * m  --@ general
  local value = false  -- a concurrency policy's key is its leases' sorted set: no GET  --@ general
  if algorithm ~= 6 then value = redis.pcall('GET', KEYS[i]) end  --@ general
  --+ local value = redis.pcall('GET', KEYS[i])
  if not value then
    value = ''
  elseif value.err then  -- an error (a string has no field err): only another type is no counter
    if sub(tostring(value.err), 1, 9) ~= 'WRONGTYPE' then return value end
    value = ''
  end
  local stride = 1  --@ general
  if algorithm == 2 or algorithm == 3 then stride = 2 end  --@ general
  local ledger_end, last, count, extra = 1, nil, 0, 0
--@ if general
  if value ~= '' then
    local length = byte(value, 1)
    ledger_end = 1 + length
--@ else
  --+ local length = byte(value, 1)  -- none without a counter
  --+ if length then ledger_end = 1 + length end
  --+ -- d + 1 (kept for the charge), t and the window's numbers in one call: the bytes past
  --+ -- the value's end are nil.
  --+ local d1, d2, d3, d4, d5, d6, t1, t2, t3, t4, t5, t6, u1, u2, u3, u4, u5, u6 =  --@ fixed_window or sliding_log
    --+ byte(value, ledger_end + 1, ledger_end + 18)  --@ fixed_window or sliding_log
  --+ local d1, d2, d3, d4, d5, d6, t1, t2, t3, t4, t5, t6, u1, u2, u3, u4, u5, u6, x1, x2, x3, x4,  --@ sliding_window or token_bucket
    --+ x5, x6 = byte(value, ledger_end + 1, ledger_end + 24)  --@ sliding_window or token_bucket
  --+ if length then
--@ end
    local size = #value
    if size == ledger_end + 12 + 6 * stride * m then  --@ general
    --+ if size == ledger_end + 18 then  -- t and one number  --@ fixed_window or sliding_log
    --+ if size == ledger_end + 24 then  -- t and two numbers  --@ sliding_window or token_bucket
      -- t and the first window's numbers in one call.  --@ general
      local t1, t2, t3, t4, t5, t6, u1, u2, u3, u4, u5, u6, x1, x2, x3, x4, x5, x6 =  --@ general
        byte(value, ledger_end + 7, ledger_end + 24)  --@ general
      last = ((((t1 * 256 + t2) * 256 + t3) * 256 + t4) * 256 + t5) * 256 + t6
      count = ((((u1 * 256 + u2) * 256 + u3) * 256 + u4) * 256 + u5) * 256 + u6
      if stride == 2 then  --@ general
--@ if sliding_window or token_bucket
        extra = ((((x1 * 256 + x2) * 256 + x3) * 256 + x4) * 256 + x5) * 256 + x6
--@ end
      end  --@ general
    elseif size ~= ledger_end + 6 then
      -- An earlier version's layout (u8 k, k 9-byte entries, d, ...) reads as no counter.
      local old = 7 + ENTRY * length  -- its size up to d
      if length <= 8 and (size == old or size == old + 6 + 6 * stride * m) then  --@ general
      --+ if length <= 8 and (size == old or size == old + 12) then  --@ fixed_window or sliding_log
      --+ if length <= 8 and (size == old or size == old + 18) then  --@ sliding_window or token_bucket
        value, ledger_end = '', 1
      else
        return redis.error_reply('django-quota: the value at ' .. KEYS[i] ..
          ' is not a counter of this policy (docs/operations.md); reset it')
      end
    end
  end
  local policy_now = now
  if last ~= nil and now < last then
    local max_regression = ((((r1 * 256 + r2) * 256 + r3) * 256 + r4) * 256 + r5) * 256 + r6 - 1
    if max_regression >= 0 and last - now > max_regression then
      return {1}
    end
    policy_now = last
  end
--@ if general
  local logs = 0
  if algorithm == 4 then
    logs = log_index
    log_index = log_index + m
  end
  local policy = {algorithm, m, call_cost, value, policy_now, logs, ledger_end, true, false,
    nil, nil, nil, nil, nil, nil, nil, nil}  -- room for two windows' views
  policies[i] = policy
--@ elif sliding_log
  --+ local logs = 2  -- KEYS[2]: the window's log
--@ end
  local cost = call_cost
  if peek then cost = 1 end
  local allowed = true
  -- Whether every window is still the one of the stored t (fixed window and sliding
  -- window counter only): then a charge may keep the counter's expiry (model.keeps_expiry).
  local same_windows = last ~= nil and (algorithm == 1 or algorithm == 2 or algorithm == 5)  --@ general
  --+ local same_windows = last ~= nil  --@ fixed_window or sliding_window
  --+ local same_windows = false  --@ token_bucket or sliding_log
  for w = 1, m do  --@ general
  --+ local w = 1
--@ if general
    if w > 1 then
      local at = first + width * (w - 1)
      l1, l2, l3, l4, l5, l6, _, _, p1, p2, p3, p4, p5, p6, _, _, q1, q2, q3, q4, q5, q6 =
        byte(packed, at + 2, at + 23)
      if last ~= nil then
        local field = ledger_end + 13 + 6 * stride * (w - 1)  -- c<w>
        local a, b, c, d, e, f, g, h, i, j, k, l = byte(value, field, field + 11)
        count = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
        if stride == 2 then
          extra = ((((g * 256 + h) * 256 + i) * 256 + j) * 256 + k) * 256 + l
        end
      end
    end
--@ end
    local limit = ((((l1 * 256 + l2) * 256 + l3) * 256 + l4) * 256 + l5) * 256 + l6
    local period = ((((p1 * 256 + p2) * 256 + p3) * 256 + p4) * 256 + p5) * 256 + p6
    local base = 5 + 4 * w  --@ general
    if algorithm == 4 then  --@ general
--@ if sliding_log
      local lv = {used = 0, inside = 0, newest = 0, oldest = 0, events = -1}
      if last ~= nil then  -- no numbers: whatever a list holds is not this counter's
        lv = log_view(KEYS[logs + w - 1], count, policy_now, period)
      end
      lv.count = count
      policy[base + 1], policy[base + 2], policy[base + 3], policy[base + 4] = lv.used, lv, limit,  --@ general
        period  --@ general
      if lv.used + cost > limit then allowed = false end
--@ end
--@ if general
    elseif algorithm == 6 then
      -- Concurrency (model._leases_at, docs/concurrency.md): the leases held at now, those
      -- scored (expiring) after it, in the set's order (oldest expiry first); each member
      -- is a fingerprint (5 bytes) and its units (2 bytes). Kept for the charge, after its
      -- one window's view: how many have expired (14), the latest held expiry (15),
      -- whether this evaluation holds one (16: a repeat).
      if #head > 5 then fingerprint = char(byte(head, 1) - 128) .. sub(head, 2, 5) end
      local leases = redis.call('ZRANGE', KEYS[i], '0', '-1', 'WITHSCORES')
      local held, wait, expired, latest, mine = 0, 0, 0, 0, false
      for j = 1, #leases, 2 do
        local expiry = leases[j + 1] + 0
        if expiry > policy_now then
          local member = leases[j]
          local u1, u2 = byte(member, 6, 7)
          if held == 0 then wait = expiry - policy_now end
          held = held + u1 * 256 + u2
          latest = expiry
          if mode == 1 and sub(member, 1, 5) == fingerprint then mine = true end
        else
          expired = expired + 1
        end
      end
      policy[base + 1], policy[base + 2], policy[base + 3], policy[base + 4] = held, wait, limit,
        period
      policy[14], policy[15], policy[16] = expired, latest, mine
      if held + cost > limit then allowed = false end
--@ end
    else  --@ general
--@ if fixed_window or sliding_window or token_bucket
      -- The window seen at now (model._view): used (the fixed count, the sliding cur, the
      -- bucket's deficit) and prev; then whether cost fits (model.allows).
      local used, prev = 0, 0
      if algorithm == 1 or algorithm == 5 then  --@ general
--@ if fixed_window
        if algorithm == 5 then
          -- A calendar call (model._places, windows.calendar_place): period holds b1; the
          -- window of policy_now among the boundaries sent, t's count when t is inside it
          -- (t <= policy_now: t is before its end), and its end kept in prev (a fixed
          -- window has none) for the lifetime.
          local at = first + 32 * (w - 1) + 18  --@ general
          --+ local at = 66
          local a1, a2, a3, a4, a5, a6, _, _, z1, z2, z3, z4, z5, z6 = byte(packed, at, at + 13)
          local start = ((((a1 * 256 + a2) * 256 + a3) * 256 + a4) * 256 + a5) * 256 + a6
          if start == 0 then  -- an epoch-aligned window of the call
            start = policy_now - policy_now % period
            prev = start + period
          elseif policy_now < period then
            if policy_now < start then return {1} end
            prev = period
          else
            prev = ((((z1 * 256 + z2) * 256 + z3) * 256 + z4) * 256 + z5) * 256 + z6
            if policy_now >= prev then return {1} end
            start = period
          end
          if last ~= nil and last >= start then
            used = count
          else
            same_windows = false
          end
        elseif last ~= nil and policy_now - policy_now % period == last - last % period then
          used = count
        else
          same_windows = false
        end
        if used + cost > limit then allowed = false end
--@ end
      elseif algorithm == 3 then  --@ general
--@ if token_bucket
        local capacity = ((((q1 * 256 + q2) * 256 + q3) * 256 + q4) * 256 + q5) * 256 + q6
        if last ~= nil then
          local deficit = count * period + extra
          local elapsed = policy_now - last
          if elapsed < -floor((-deficit) / limit) then used = deficit - elapsed * limit end
        end
        if used + cost * period > capacity * period then allowed = false end
--@ end
      else  --@ general
--@ if sliding_window
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
--@ end
      end  --@ general
      policy[base + 1], policy[base + 2], policy[base + 3], policy[base + 4] = used, prev, limit,  --@ general
        period  --@ general
--@ end
    end  --@ general
  end  --@ general
  if not allowed then
    policy[8] = false  --@ general
    if enforce == 1 then commit = false end
  end
  policy[9] = same_windows  --@ general
end  --@ general

-- Whether the ledger of value (entries up to byte ledger_end) holds the fingerprint in an
-- entry charged less than DEDUP_TTL before now, whatever the cost it records.
local remembers
local replay = false
if mode == 1 then
  local first_byte, rest = byte(head, 1), sub(head, 2, 5)  -- the fingerprint's
  if first_byte >= 128 then first_byte = first_byte - 128 end
  remembers = function(value, ledger_end, at_now)
    local i = 2
    while i < ledger_end do
      local first = byte(value, i)
      local stamp = i + 5  -- its charge time modulo 2^32, after the fingerprint
      if first >= 128 then  -- and after a cost
        first = first - 128
        stamp = i + 11
      end
      if first == first_byte and sub(value, i + 1, i + 4) == rest then
        local b1, b2, b3, b4 = byte(value, stamp, stamp + 3)
        if (at_now - (((b1 * 256 + b2) * 256 + b3) * 256 + b4)) % STAMP < dedup_ttl then
          return true
        end
      end
      i = stamp + 4
    end
    return false
  end
--@ if general
  for i = 1, n do
    local policy = policies[i]
    if (policy[1] == 6 and policy[16]) or remembers(policy[4], policy[7], policy[5]) then
      replay = true
      commit = false
      break
    end
  end
  if not replay then
    for i = 1, n do
      local policy = policies[i]
      local value, ledger_end, policy_now = policy[4], policy[7], policy[5]
--@ else
  --+ if remembers(value, ledger_end, policy_now) then
    --+ replay = true
    --+ commit = false
  --+ else
    --+ do
--@ end
      if value ~= '' then
        local a, b, c, d, e, f = byte(value, ledger_end + 1, ledger_end + 6)
        local dropped = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f - 1
        if dropped >= 0 and policy_now - dropped < dedup_ttl then
          return {2}
        end
      end
    end
  end
end

-- The reply, then the writes. Per policy: its status only when replayed (else the client
-- derives it from the views, as model.evaluate_group decides), its effective now, then
-- per window its view or, for a sliding log, its numbers.
-- (A one-window variant other than the sliding log's builds it in one constructor: a
-- table grown or set index by index costs more.)
local reply = {0, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}  --@ general
--+ local reply  --@ fixed_window or sliding_window or token_bucket
--+ local reply = {0, nil, nil, nil, nil, nil, nil}  --@ sliding_log
local r = 1  -- the reply's last index  --@ general or sliding_log
if replay then reply[1] = 3 end  --@ general or sliding_log
for i = 1, n do  --@ general
  local policy = policies[i]  --@ general
  local algorithm, m, call_cost, value, policy_now, logs, ledger_end, allowed, same_windows =  --@ general
    policy[1], policy[2], policy[3], policy[4], policy[5], policy[6], policy[7], policy[8],  --@ general
    policy[9]  --@ general
  local cost = call_cost  --@ general
  if peek then cost = 1 end  --@ general
  local charged = commit and allowed and call_cost > 0
--@ if general
  if charged and algorithm == 6 then
    -- A concurrency policy acquires (model._lease_charge): the expired leases leave, the
    -- new one (fingerprint, units) expires at now + period; the set lives until its latest
    -- lease expires, plus the grace. No counter string.
    charged = false
    local expiry = policy_now + policy[13]
    if policy[14] > 0 then
      redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', format('%d', policy_now))
    end
    local low = call_cost % 256
    redis.call('ZADD', KEYS[i], format('%d', expiry),
      fingerprint .. char((call_cost - low) / 256, low))
    local latest = policy[15]
    if expiry > latest then latest = expiry end
    local grace = ((((g1 * 256 + g2) * 256 + g3) * 256 + g4) * 256 + g5) * 256 + g6
    redis.call('PEXPIRE', KEYS[i], format('%d', latest - policy_now + grace))
  end
--@ end
  if replay then
    -- charged by the earlier evaluation when its ledger holds the id (cluster refunds)
    local status = 2
    if remembers(value, ledger_end, policy_now) then status = 1 end
    if algorithm == 6 and policy[16] then status = 1 end  -- holds its lease  --@ general
    r = r + 1  --@ general or sliding_log
    reply[r] = status  --@ general or sliding_log
    --+ reply = {3, status, policy_now, used}  --@ fixed_window or token_bucket
    --+ reply = {3, status, policy_now, used, prev}  --@ sliding_window
  --+ else  --@ fixed_window or token_bucket or sliding_window
    --+ reply = {0, policy_now, used}  --@ fixed_window or token_bucket
    --+ reply = {0, policy_now, used, prev}  --@ sliding_window
  end
  r = r + 1  --@ general or sliding_log
  reply[r] = policy_now  --@ general or sliding_log
  -- Per window: a sliding log's four reported numbers (model._log_result); for the other
  -- algorithms the window's view (used, and prev for the sliding window counter:
  -- model._view), from which the client computes the reported numbers
  -- (model.window_result). A charge needs the windows' time to live and new numbers (a,
  -- and b for the sliding window counter and the token bucket), as u48s for more than one
  -- window (with one they join d and t in a single char() call).
  local ttl, a, b, numbers = 0, nil, nil, nil
  for w = 1, m do  --@ general
    local base = 5 + 4 * w  --@ general
    local limit, period = policy[base + 3], policy[base + 4]  --@ general
    local window_ttl = 0
    if algorithm == 4 then  --@ general
--@ if sliding_log
      local lv = policy[base + 2]  --@ general
      window_ttl = log_result(reply, r, KEYS[logs + w - 1], limit, period, lv, policy_now, cost,
        charged, replay)
      r = r + 4
      if charged then
        a = (lv.count + call_cost) % LOG_MODULUS
        log_charge(KEYS[logs + w - 1], period, lv, policy_now)
      end
--@ end
    else  --@ general
--@ if fixed_window or sliding_window or token_bucket
--@ if general
      local used, prev = policy[base + 1], policy[base + 2]
      r = r + 1
      reply[r] = used
      if algorithm == 2 or algorithm == 6 then
        r = r + 1
        reply[r] = prev
      end
--@ end
      if charged then
        if algorithm == 1 or algorithm == 5 then  --@ general
--@ if fixed_window
          if prev > 0 then  -- a calendar call: to its window's end
            window_ttl = prev - policy_now
          else
            window_ttl = period - policy_now % period
          end
          a = used + call_cost
--@ end
        elseif algorithm == 3 then  --@ general
--@ if token_bucket
          local deficit = used + call_cost * period
          window_ttl = -floor(-deficit / limit)
          a = floor(deficit / period)
          b = deficit - a * period
--@ end
        else  --@ general
--@ if sliding_window
          window_ttl = period - policy_now % period + period
          a, b = used + call_cost, prev
--@ end
        end  --@ general
      end
--@ end
    end  --@ general
    if window_ttl > ttl then ttl = window_ttl end
--@ if general
    if charged and m > 1 then
      if w == 1 then numbers = {} end
      numbers[w] = char(split48(a))
      if b then numbers[w] = numbers[w] .. char(split48(b)) end
    end
  end
--@ end
  if charged then
    -- The ledger with this evaluation's entry (head, charge time) appended, the oldest
    -- dropped while it is over LEDGER_BYTES; d, then the numbers.
    local length = ledger_end - 1 + #head + 4  -- the ledger's bytes
    local kept = 2  -- byte of the oldest entry kept
--@ if general
    local source = value  -- for d + 1 as stored: none (six zeros) without a counter
    if source == '' then source = '\0\0\0\0\0\0\0' end
    local d1, d2, d3, d4, d5, d6 = byte(source, ledger_end + 1, ledger_end + 6)
--@ else
    --+ if value == '' then d1, d2, d3, d4, d5, d6 = 0, 0, 0, 0, 0, 0 end  -- d + 1: none (no counter)
--@ end
    while length > LEDGER_BYTES do
      -- The oldest's charge time modulo 2^32: after its fingerprint, or after its cost
      -- too when its first bit is set.
      local first, _, _, _, _, b1, b2, b3, b4 = byte(value, kept, kept + 8)
      local size = ENTRY
      if first >= 128 then
        size = ENTRY + 6
        b1, b2, b3, b4 = byte(value, kept + 11, kept + 14)
      end
      local age = (policy_now - (((b1 * 256 + b2) * 256 + b3) * 256 + b4)) % STAMP
      if age < dedup_ttl then  -- d + 1 = its charge time + 1 (split48 written out)
        local x = policy_now - age + 1
        d6 = x % 256
        x = (x - d6) / 256
        d5 = x % 256
        x = (x - d5) / 256
        d4 = x % 256
        x = (x - d4) / 256
        d3 = x % 256
        x = (x - d3) / 256
        d2 = x % 256
        d1 = (x - d2) / 256
      end
      kept = kept + size
      length = length - size
    end
    -- t's six bytes (split48 written out: a call costs more), the entry's stamp its low
    -- four (the charge time modulo 2^32).
    local t6 = policy_now % 256
    local t = (policy_now - t6) / 256
    local t5 = t % 256
    t = (t - t5) / 256
    local t4 = t % 256
    t = (t - t4) / 256
    local t3 = t % 256
    t = (t - t3) / 256
    local t2 = t % 256
    local t1 = (t - t2) / 256
    local ledger_byte, entries_kept = char(length), sub(value, kept, ledger_end)
    local stored
--@ if general
    if m > 1 then
      stored = ledger_byte .. entries_kept .. head
        .. char(t3, t4, t5, t6, d1, d2, d3, d4, d5, d6, t1, t2, t3, t4, t5, t6)
        .. table.concat(numbers)
    else
--@ end
      local a6 = a % 256  -- split48(a) written out
      a = (a - a6) / 256
      local a5 = a % 256
      a = (a - a5) / 256
      local a4 = a % 256
      a = (a - a4) / 256
      local a3 = a % 256
      a = (a - a3) / 256
      local a2 = a % 256
      local a1 = (a - a2) / 256
      if b then  --@ general
--@ if general or sliding_window or token_bucket
        local b6 = b % 256  -- split48(b) written out
        b = (b - b6) / 256
        local b5 = b % 256
        b = (b - b5) / 256
        local b4 = b % 256
        b = (b - b4) / 256
        local b3 = b % 256
        b = (b - b3) / 256
        local b2 = b % 256
        local b1 = (b - b2) / 256
        stored = ledger_byte .. entries_kept .. head .. char(t3, t4, t5, t6, d1, d2, d3,
          d4, d5, d6, t1, t2, t3, t4, t5, t6, a1, a2, a3, a4, a5, a6, b1, b2, b3, b4, b5, b6)
--@ end
      else  --@ general
--@ if general or fixed_window or sliding_log
        stored = ledger_byte .. entries_kept .. head .. char(t3, t4, t5, t6, d1, d2, d3,
          d4, d5, d6, t1, t2, t3, t4, t5, t6, a1, a2, a3, a4, a5, a6)
--@ end
      end  --@ general
    end  --@ general
    if same_windows and server_clock and policy_now == now and ttl >= dedup_ttl then
      -- The expiry set by the charge at t is late enough (model.keeps_expiry).
      redis.call('SET', KEYS[i], stored, 'KEEPTTL')
    else
      local grace = ((((g1 * 256 + g2) * 256 + g3) * 256 + g4) * 256 + g5) * 256 + g6
      local lifetime = ttl + grace
      if lifetime < dedup_ttl then lifetime = dedup_ttl end
      redis.call('SET', KEYS[i], stored, 'PX', format('%d', lifetime))
    end
  end
end  --@ general
return reply
