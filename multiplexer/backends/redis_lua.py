"""The Lua scripts: each decision is one atomic script on Redis's own clock (``TIME``).

Buckets follow ``core/limiter.TokenBucket`` exactly (refill ``r``/s up to ``c``; until
``u`` a learned rate ``g`` so the bucket is full when the upstream said it resets),
so one gateway and N replicas admit the same. Numbers are written with ``%.17g``.
"""

COMMON = r"""
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function load(key, cfg, now)
  local h = redis.call('HMGET', key, 'l', 's', 'r', 'c', 'g', 'u', 'k')
  local b
  if h[1] then
    b = {l = tonumber(h[1]), s = tonumber(h[2]), r = tonumber(h[3]), c = tonumber(h[4]),
         g = tonumber(h[5]), u = tonumber(h[6]), k = tonumber(h[7]) or 0}
  elseif cfg > 0 then
    b = {l = cfg, s = now, r = cfg / 60, c = cfg, g = 0, u = 0, k = cfg}
  else
    return nil
  end
  -- k: the configured limit the bucket follows; a new one (raised or lowered) takes over,
  -- as in a restarted gateway, while a learned lower limit under the same one stays
  if cfg > 0 and (b.k ~= cfg or b.c > cfg) then
    b.c = cfg; b.r = cfg / 60; b.l = math.min(b.l, cfg); b.k = cfg
  end
  if now > b.s then
    local gain, t = 0, b.s
    if b.u > t then
      local seg = math.min(now, b.u) - t
      gain = seg * b.g; t = t + seg
    end
    gain = gain + (now - t) * b.r
    b.l = math.min(b.c, b.l + gain); b.s = now
  end
  return b
end

local function delay(b, amount, now)
  local need = math.min(amount, b.c) - b.l
  if need <= 0 then return 0 end
  local wait = 0
  if b.u > now then
    local span = b.u - now
    if need <= span * b.g then return need / b.g end
    need = need - span * b.g; wait = span
  end
  if b.r <= 0 then return 3600 end
  return wait + need / b.r
end

local function f(x) return string.format('%.17g', x) end

local function save(key, b)
  redis.call('HSET', key, 'l', f(b.l), 's', f(b.s), 'r', f(b.r), 'c', f(b.c), 'g', f(b.g), 'u', f(b.u),
             'k', f(b.k or 0))
  redis.call('EXPIRE', key, 86400)
end
"""

# KEYS: rpm bucket, tpm bucket, in-flight ZSET.  ARGV: rpm, tpm, concurrency, lease_s, then per
# waiter, in the order they wait: lease id ('' takes no concurrency slot), tokens.
# Grants the waiters in order, each all or none (a request, its tokens, its slot), and stops at
# the first that must wait: as many single decisions taken at one instant, so together they never
# admit more than one would. Returns {seconds until the first not granted could go (when all were:
# one more request, a lower bound), the limit that holds it, rpm bucket level after ('' without
# one), Redis time, how many were granted, tpm bucket level after ('' without one)}
ACQUIRE = COMMON + r"""
local now = now_s()
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
local rb = load(KEYS[1], rpm, now)
local tb = load(KEYS[2], tpm, now)
local busy = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - lease)
  busy = redis.call('ZCARD', KEYS[3])
end
local function hold(id, tokens)
  local wait, which = 0, ''
  if rb then
    local w = delay(rb, 1, now)
    if w > wait then wait, which = w, 'rpm' end
  end
  if tb and tokens > 0 then
    local w = delay(tb, tokens, now)
    if w > wait then wait, which = w, 'tpm' end
  end
  if wait == 0 and conc > 0 and id ~= '' and busy >= conc then wait, which = 0.001, 'concurrency' end
  return wait, which
end
local granted, wait, which, spent, slots = 0, 0, '', false, false
for i = 5, #ARGV, 2 do
  local id, tokens = ARGV[i], tonumber(ARGV[i + 1])
  wait, which = hold(id, tokens)
  if wait > 0 then break end
  if rb then rb.l = rb.l - 1 end
  if tb and tokens > 0 then tb.l = tb.l - tokens; spent = true end
  if conc > 0 and id ~= '' then
    redis.call('ZADD', KEYS[3], now, id); busy = busy + 1; slots = true
  end
  granted = granted + 1
end
if wait == 0 then wait, which = hold('', 0) end
if granted > 0 and rb then save(KEYS[1], rb) end
if spent then save(KEYS[2], tb) end
if slots then redis.call('EXPIRE', KEYS[3], 86400) end
-- the buckets' levels after this decision and the time it was taken: a key's quota
-- headers come from this reply, with no round trip of their own
local level, tlevel = '', ''
if rb then level = f(rb.l) end
if tb then tlevel = f(tb.l) end
return {string.format('%.6f', wait), which, level, f(now), granted, tlevel}
"""

# KEYS: rpm, tpm, in-flight.  ARGV: rpm, tpm, lease id ('' none), token delta, requests given
# back (granted, never sent), then per reading: kind, limit (-1 unknown), remaining, reset_in
SETTLE = COMMON + r"""
local now = now_s()
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[3], ARGV[3]) end
local delta, back = tonumber(ARGV[4]), tonumber(ARGV[5])
if delta ~= 0 then
  local tb = load(KEYS[2], tpm, now)
  if tb then tb.l = math.min(tb.c, tb.l - delta); save(KEYS[2], tb) end
end
if back > 0 then
  local rb = load(KEYS[1], rpm, now)
  if rb then rb.l = math.min(rb.c, rb.l + back); save(KEYS[1], rb) end
end
for i = 6, #ARGV, 4 do
  local key, cfg = KEYS[1], rpm
  if ARGV[i] == 'tokens' then key, cfg = KEYS[2], tpm end
  local limit, remaining, reset = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local b = load(key, cfg, now)
  if not b and limit > 0 then b = {l = limit, s = now, r = limit / 60, c = limit, g = 0, u = 0} end
  if b then
    if limit > 0 then
      local cap = limit
      if cfg > 0 then cap = math.min(limit, cfg) end
      if cap ~= b.c then b.c = cap; b.r = cap / 60; b.l = math.min(b.l, cap) end
    end
    if remaining < b.l then b.l = remaining end
    if reset > 0 and b.l < b.c then b.g = (b.c - b.l) / reset; b.u = now + reset else b.u = 0 end
    save(key, b)
  end
end
return 1
"""

# KEYS: in-flight ZSET.  ARGV: lease ids still running
RENEW = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
return 1
"""

# KEYS: replicas ZSET.  ARGV: replica id, lease_s.  Returns the replicas alive within the lease.
HEARTBEAT = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], 86400)
return redis.call('ZCARD', KEYS[1])
"""

# KEYS: the key's counter for one UTC day.  ARGV: calls, allowed.  -1 when charged, else what is left.
BATCH_CHARGE = r"""
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local calls, allowed = tonumber(ARGV[1]), tonumber(ARGV[2])
if used + calls > allowed then return math.max(allowed - used, 0) end  -- never -1: 'charged'
redis.call('INCRBY', KEYS[1], calls)
redis.call('EXPIRE', KEYS[1], 172800)
return -1
"""

# KEYS: lock, cache.  ARGV: token, lease_ms.  A cached result comes with the ms it has left.
CLAIM = r"""
local c = redis.call('GET', KEYS[2])
if c then return {'cached', c, redis.call('PTTL', KEYS[2])} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'won', ARGV[1]} end
return {'held', redis.call('GET', KEYS[1]) or ''}
"""

# KEYS: lock, result, cache, end.  ARGV: token, result JSON, result ttl ms, cache ttl ms (0: none)
# The end stream wakes every replica waiting on this flight (XREAD BLOCK: no polling).
PUBLISH = r"""
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4]) end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('XADD', KEYS[4], '*', 'end', '1')
redis.call('PEXPIRE', KEYS[4], ARGV[3])
return 1
"""

# KEYS: lock, end.  ARGV: token, end ttl ms.  The flight ended without a result: free the key
# (if still ours) and wake the replicas waiting on it, which then claim it themselves.
ABANDON = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('XADD', KEYS[2], '*', 'end', '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: lock.  ARGV: token, lease_ms (0: delete).  1 if the lock was still ours.
KEEP = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: lock, result.  ARGV: token.  {1, result} | {0} while held | {-1} ended without a result
RESULT = r"""
local r = redis.call('GET', KEYS[2])
if r then return {1, r} end
if redis.call('GET', KEYS[1]) == ARGV[1] then return {0} end
return {-1}
"""

# Budgets (money/budgets.py): one key per cap and period, integer nano-dollars.
# KEYS: the caller's counters.  ARGV: amount, cold ('1': a missing counter is answered, not made),
# then per key: limit, alert (0: none), ttl_ms (0: kept).
# With cold '1' and a counter missing (a new period, or a Redis that lost it): {-1, 0, indexes of
# the missing ones}, nothing changed, so the caller seeds them (BUDGET_SEED) and asks again.
# Refused while any counter has reached its limit: {index, spend}; else every counter grows by
# amount and {0, 0, alerts...}: the indexes whose alert share was crossed now (once per period:
# the flag lives as long as its counter, and a counter with no period is never reset, so neither
# is its flag).
BUDGET_RESERVE = r"""
local amount = tonumber(ARGV[1])
local missing = {-1, 0}
for i = 1, #KEYS do
  local spent = redis.call('GET', KEYS[i])
  if not spent and ARGV[2] == '1' then
    missing[#missing + 1] = i - 1
  elseif tonumber(spent or '0') >= tonumber(ARGV[3 * i]) then
    return {i, tonumber(spent or '0')}
  end
end
if #missing > 2 then return missing end
local out = {0, 0}
for i = 1, #KEYS do
  local spent = redis.call('INCRBY', KEYS[i], amount)
  local alert, ttl = tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) end
  if alert > 0 and spent >= alert then
    local fresh
    if ttl > 0 then
      fresh = redis.call('SET', KEYS[i] .. ':alerted', '1', 'NX', 'PX', ttl)
    else
      fresh = redis.call('SET', KEYS[i] .. ':alerted', '1', 'NX')
    end
    if fresh then out[#out + 1] = i - 1 end
  end
end
return out
"""

# KEYS: counters Redis does not have.  ARGV: per key: the spend the store recorded, ttl_ms (0:
# kept).  Each is set only if still missing: a replica that seeded it first, and the calls it
# counted since, win.
BUDGET_SEED = r"""
for i = 1, #KEYS do
  local ttl = tonumber(ARGV[2 * i])
  if ttl > 0 then
    redis.call('SET', KEYS[i], ARGV[2 * i - 1], 'NX', 'PX', ttl)
  else
    redis.call('SET', KEYS[i], ARGV[2 * i - 1], 'NX')
  end
end
return 0
"""

# KEYS: counters.  ARGV: a delta per key (a settlement: the cost minus the reservation).
# A counter whose period ended is gone: nothing is added to it.
BUDGET_SETTLE = r"""
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], tonumber(ARGV[i])) end
end
return 0
"""
