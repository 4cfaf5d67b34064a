"""Every system check id, with the wording and the fix of each message reported under it.

One place, so that an id is defined once and a message is worded once: the ids, then
the settings parser's messages (:class:`Problems`, read by :mod:`django_quota.fields` and
:mod:`django_quota.conf`) and the system checks' (:class:`Checks`, read by
:mod:`django_quota.checks` and the log lines that cite an id). ``docs/checks.md`` has a
section per id. This module imports nothing of the package, so any layer may use it.

A wording is a :meth:`str.format` template: ``{value!r}`` is filled in where it is
reported, and a literal brace is written twice.
"""

from __future__ import annotations

from dataclasses import dataclass


# -- the ids -------------------------------------------------------------------------------
class Codes:
    """Every check id: ``E_*`` errors, ``W_*`` warnings (``docs/checks.md``)."""

    E_NOT_A_DICT = "django_quota.E001"
    E_UNKNOWN_KEY = "django_quota.E002"
    E_INVALID_VALUE = "django_quota.E003"
    E_INVALID_POLICY = "django_quota.E004"
    E_BACKEND = "django_quota.E005"
    E_CACHE_ALIAS = "django_quota.E006"
    E_DUPLICATE_POLICY = "django_quota.E007"
    E_DOTTED_PATH = "django_quota.E008"
    E_UNKNOWN_VIEW_POLICY = "django_quota.E009"
    E_MIDDLEWARE_BEFORE_AUTHENTICATION = "django_quota.E010"
    E_DUPLICATE_HEADER_ITEM = "django_quota.E011"
    E_FOLDED_GENERATED_ID = "django_quota.E012"
    E_DRF_RATE = "django_quota.E013"
    E_LOGIN_PROTECTION = "django_quota.E014"
    W_MEMORY_IN_PRODUCTION = "django_quota.W001"
    W_HMAC_KEY_UNSET = "django_quota.W002"
    W_DRF_NUM_PROXIES = "django_quota.W003"
    W_MIDDLEWARE_DENIES_ANONYMOUS = "django_quota.W004"
    W_CLIENT_CLOCK = "django_quota.W005"
    W_MIDDLEWARE_MISSING = "django_quota.W006"
    W_RESOLVER_BEFORE_AUTHENTICATION = "django_quota.W007"
    W_REDIS_URL_IGNORED = "django_quota.W008"
    W_REDIS_EVICTS = "django_quota.W009"


@dataclass(frozen=True, slots=True)
class Message:
    """One message: the check ``id`` it is reported under, its ``text`` and its ``hint``."""

    id: str
    text: str
    hint: str | None = None

    @classmethod
    def invalid(cls, text: str, hint: str | None = None) -> Message:
        """A message reported under E003, an invalid value (most of the parser's)."""
        return cls(Codes.E_INVALID_VALUE, text, hint)

    def render(self, **values: object) -> tuple[str, str | None]:
        """The text and the hint with ``values`` filled in."""
        hint = None if self.hint is None else self.hint.format(**values)
        return self.text.format(**values), hint

    def logged(self, **values: object) -> str:
        """The text with ``values`` filled in and the id in brackets, for a log line."""
        return f"{self.text.format(**values)} ({self.id})"


class Problems:
    """What the parser of ``settings.QUOTA`` reports (:mod:`django_quota.conf`): E001 to
    E005 and E008; E004's wording comes from :func:`~django_quota.core.policy.parse_policy`."""

    NOT_A_DICT = Message(Codes.E_NOT_A_DICT, "settings.QUOTA must be a dict, not {type}")
    UNKNOWN_KEY = Message(Codes.E_UNKNOWN_KEY, "unknown setting", "known settings: {known}")
    EXPECTED_BOOLEAN = Message.invalid("expected True or False, not {value!r}")
    EXPECTED_SECONDS = Message.invalid(
        "expected a number of seconds >= {minimum:g} and <= {maximum:g}, not {value!r}",
    )
    EXPECTED_INTEGER_BETWEEN = Message.invalid(
        "expected an integer between {minimum} and {maximum}, not {value!r}"
    )
    EXPECTED_INTEGER_AT_LEAST = Message.invalid("expected an integer >= {minimum}, not {value!r}")
    EXPECTED_OPTIONAL_STRING = Message.invalid("expected a string or None, not {value!r}")
    NOT_A_CHOICE = Message.invalid("{value!r} is not one of {choices}")
    NOT_A_CHOICE_OR_NONE = Message.invalid("{value!r} is not one of {choices} (or None)")
    EXPECTED_STRING_LIST = Message.invalid("expected a list of strings, not {value!r}")
    EXPECTED_REDIS_URL = Message.invalid(
        "expected a redis://, rediss:// or unix:// URL (a str) or None, not a {type}",
    )
    #: ``{found}`` says what the URL is without showing it: it may carry the password.
    EXPECTED_REDIS_SCHEME = Message.invalid(
        "expected a redis://, rediss:// or unix:// URL, not {found}"
    )
    #: ``{problem}`` says what redis-py refused without quoting the URL (it may hold a
    #: password): ``django_quota.backends.unusable_url``.
    UNUSABLE_REDIS_URL = Message.invalid(
        "not a URL redis-py can connect to: {problem}",
        "fix the port, host or query options; the value is not shown (it may hold a password)",
    )
    FOUND_URL_SCHEME = "a URL with scheme {scheme!r}"
    FOUND_NO_SCHEME = "text without a scheme (the value is not shown: it may hold a password)"
    #: Without the app, nothing registers the checks or drops what settings changes make
    #: stale (docs/settings.md): every use says so rather than fail deep inside.
    APP_NOT_INSTALLED = (
        "django_quota is not in INSTALLED_APPS: add 'django_quota' to INSTALLED_APPS (it "
        "registers the system checks and the listeners that keep the limits current)"
    )
    EXPECTED_SENTINEL = Message.invalid(
        "expected {{'SENTINELS': [(host, port), ...], 'SERVICE': 'mymaster'}}",
    )
    EXPECTED_KEY_PREFIX = Message.invalid(
        "expected a non-empty string without braces or spaces, not {value!r}"
    )
    EXPECTED_LOCAL_FALLBACK = Message.invalid("expected {{'ENABLED': bool, 'MAX_ENTRIES': int}}")
    EXPECTED_DENIAL_CACHE = Message.invalid(
        "expected {{'ENABLED': bool, 'MAX_ENTRIES': int, 'MAX_TTL': seconds}}",
    )
    EXPECTED_TRUE_OR_FALSE = Message.invalid("expected True or False")
    EXPECTED_POSITIVE_INTEGER = Message.invalid("expected a positive integer")
    EXPECTED_HMAC_KEY = Message.invalid(
        "expected a secret string or bytes of at least 16 characters",
        "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
    )
    NOT_A_CIDR = Message.invalid("{value!r} is not a CIDR")
    EXPECTED_PROXY_COUNT = Message.invalid("expected None or an integer >= 0, not {value!r}")
    EXPECTED_HEADER_NAME = Message.invalid(
        "expected an HTTP header name like 'X-Api-Key', not {value!r}"
    )
    PATH_WITHOUT_SLASH = Message.invalid("{value!r} must start with '/'")
    UNKNOWN_TIMEZONE = Message.invalid(
        "unknown timezone {value!r}; use an IANA name like 'Europe/Berlin'"
    )
    HOST_TIMEZONE = Message.invalid(
        "{value!r} is this host's zoneinfo file, not an IANA zone name: every process must "
        "cut days at the same instant; name the zone, like 'Europe/Berlin'",
    )
    EXPECTED_POLICY_DICT = Message.invalid("expected a dict of id -> policy")
    DEADLINE_BELOW_TIMEOUT = Message.invalid(
        "DEADLINE ({deadline:g} s) must be at least TIMEOUT ({timeout:g} s)"
    )
    REDIS_WITHOUT_SERVER = Message(
        Codes.E_BACKEND, "the redis backend needs REDIS_URL, CACHE_ALIAS or SENTINEL"
    )
    CLUSTER_WITH_SENTINEL = Message(Codes.E_BACKEND, "CLUSTER and SENTINEL exclude each other")
    CLUSTER_WITHOUT_URL = Message(Codes.E_BACKEND, "CLUSTER needs REDIS_URL or CACHE_ALIAS")
    CANNOT_IMPORT = Message(Codes.E_DOTTED_PATH, "cannot import {value!r}: {error}")
    NOT_CALLABLE = Message(Codes.E_DOTTED_PATH, "{value!r} is not callable")


class Checks:
    """What the system checks (:mod:`django_quota.checks`) report, and the log lines that
    cite one of their ids."""

    NO_SUCH_CACHE = Message(
        Codes.E_CACHE_ALIAS,
        "QUOTA['CACHE_ALIAS']: no cache named {alias!r} in CACHES",
        "define CACHES[{alias!r}] with django-redis, or set REDIS_URL instead",
    )
    CACHE_NOT_DJANGO_REDIS = Message(
        Codes.E_CACHE_ALIAS,
        "QUOTA['CACHE_ALIAS']: cache {alias!r} uses {backend!r}, not django-redis",
        "use django_redis.cache.RedisCache for that cache, or set REDIS_URL",
    )
    DUPLICATE_POLICY = Message(
        Codes.E_DUPLICATE_POLICY,
        "QUOTA['POLICIES'][{policy!r}] is also a database policy; the database row is ignored",
        "rename or delete one of them (admin: Quota policies)",
    )
    #: The registry's log line for the same conflict, once per registry.
    DUPLICATE_POLICY_LOGGED = Message(
        Codes.E_DUPLICATE_POLICY,
        "quota policy {policy!r} is defined in settings and in the database; the database row "
        "is ignored",
    )
    UNKNOWN_VIEW_POLICY = Message(
        Codes.E_UNKNOWN_VIEW_POLICY,
        "the view at {route!r} names policy {policy!r}, which is not defined",
        "add it to QUOTA['POLICIES'] or the admin, or fix the name",
    )
    _BEFORE_AUTHENTICATION = (
        "QuotaMiddleware comes before AuthenticationMiddleware in MIDDLEWARE, so "
    )
    _MOVE_AFTER_AUTHENTICATION = "move {middleware!r} after {authentication!r} in MIDDLEWARE"
    #: How E010 and W007 name a policy: ``{policy} (selector {selector})``.
    NAMED_POLICY = "{policy} (selector {selector})"
    SETTINGS_POLICY = "QUOTA['POLICIES'][{id!r}]"
    OTHER_POLICY = "policy {id!r} ({source})"
    MIDDLEWARE_BEFORE_AUTHENTICATION = Message(
        Codes.E_MIDDLEWARE_BEFORE_AUTHENTICATION,
        _BEFORE_AUTHENTICATION + "request.user is not set when it applies {named}: {effect}",
        _MOVE_AFTER_AUTHENTICATION,
    )
    #: What E010 does to logged-in users, by the policy's selector and ``on_missing``.
    USER_COUNTED_PER_IP = "logged-in users are counted per IP address"
    USER_NEVER_LIMITED = "logged-in users are never limited"
    USER_ALWAYS_REFUSED = "every request is refused as selector_identity_missing"
    RESOLVER_BEFORE_AUTHENTICATION = Message(
        Codes.W_RESOLVER_BEFORE_AUTHENTICATION,
        _BEFORE_AUTHENTICATION + "QUOTA[{setting!r}] runs before request.user is set for "
        "{named}: a resolver that reads request.user finds no user",
        _MOVE_AFTER_AUTHENTICATION,
    )
    DUPLICATE_HEADER_ITEM = Message(
        Codes.E_DUPLICATE_HEADER_ITEM,
        'the rate-limit header item "{name}" would name both {owners}',
        "rename one of the policies or windows",
    )
    #: One owner of a header item in E011, joined with " and ".
    HEADER_ITEM_OWNER = "policy {policy!r} (window {window!r})"
    #: One view in E012, joined with " and ".
    VIEW_AT = "{name} (at {route!r})"
    FOLDED_VIEW_IDS = Message(
        Codes.E_FOLDED_GENERATED_ID,
        "the views {listed} generate the same policy id {policy!r} and would share its counters",
        "rename one of them, or give one @quota(policy=...) with a policy of its own",
    )
    FOLDED_SCOPE_IDS = Message(
        Codes.E_FOLDED_GENERATED_ID,
        "the DRF throttle scopes {listed} in REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] generate "
        "the same policy id {policy!r} and would share its counters",
        "rename one of the scopes",
    )
    DRF_RATES_NOT_A_DICT = Message(
        Codes.E_DRF_RATE,
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'] must be a dict of scope -> rate, not {type}",
        "e.g. {{'anon': '100/day', 'user': '1000/day'}}",
    )
    DRF_RATE_UNUSABLE = Message(
        Codes.E_DRF_RATE,
        "REST_FRAMEWORK['DEFAULT_THROTTLE_RATES'][{scope!r}]: {error}",
        "write {grammar}, or None for no limit",
    )
    # -- login protection (docs/login.md) --
    LOGIN_POLICY_UNKNOWN = Message(
        Codes.E_UNKNOWN_VIEW_POLICY,
        "QUOTA['LOGIN_POLICIES'] names policy {policy!r}, which is not defined",
        "add it to QUOTA['POLICIES'] or the admin, or fix the name",
    )
    LOGIN_BACKEND_NOT_FIRST = Message(
        Codes.E_LOGIN_PROTECTION,
        "QUOTA['LOGIN_POLICIES'] is set but {backend!r} is {where} in "
        "AUTHENTICATION_BACKENDS: passwords are checked before the login policies refuse",
        "put {backend!r} first in AUTHENTICATION_BACKENDS",
    )
    LOGIN_BACKEND_MISSING = "missing"
    LOGIN_BACKEND_LATE = "not first"
    LOGIN_SELECTOR = Message(
        Codes.E_LOGIN_PROTECTION,
        "QUOTA['LOGIN_POLICIES'] names policy {policy!r}, whose selector {selector} uses "
        "more than user (the submitted username) and ip",
        "give the login policy a selector of ['user'], ['ip'] or ['user', 'ip']",
    )
    LOGIN_MIDDLEWARE_MISSING = Message(
        Codes.E_LOGIN_PROTECTION,
        "QUOTA['LOGIN_POLICIES'] is set but QuotaMiddleware is not in MIDDLEWARE: a refused "
        "login answers the login form's error, not 429 with Retry-After",
        "add {middleware!r} after AuthenticationMiddleware",
    )
    MEMORY_IN_PRODUCTION = Message(
        Codes.W_MEMORY_IN_PRODUCTION,
        "QUOTA['BACKEND']: the memory backend keeps counters per process; with several "
        "processes each admits the full limit",
        "set QUOTA['REDIS_URL'] (or CACHE_ALIAS / SENTINEL) in production",
    )
    HMAC_KEY_UNSET = Message(
        Codes.W_HMAC_KEY_UNSET,
        "QUOTA['HMAC_KEY'] is unset: pseudonyms derive from SECRET_KEY, so rotating "
        "SECRET_KEY resets every counter",
        "set QUOTA['HMAC_KEY'] to a dedicated secret",
    )
    DRF_NUM_PROXIES = Message(
        Codes.W_DRF_NUM_PROXIES,
        "REST_FRAMEWORK['NUM_PROXIES'] is set but QUOTA['TRUSTED_PROXIES'] and "
        "QUOTA['PROXY_COUNT'] are not: the drop-in DRF throttles follow NUM_PROXIES, "
        "but the middleware, @quota and QuotaThrottle key on REMOTE_ADDR, the proxy's address",
        "set QUOTA['PROXY_COUNT'] to the same number, or list TRUSTED_PROXIES, so that every "
        "layer sees the same client",
    )
    MIDDLEWARE_DENIES_ANONYMOUS = Message(
        Codes.W_MIDDLEWARE_DENIES_ANONYMOUS,
        "QUOTA['POLICIES'][{policy!r}]: a middleware policy selecting {dimensions} with "
        "on_missing 'deny' refuses every request without that dimension (anonymous users, "
        "DRF-authenticated clients)",
        "use selector ['auto'], on_missing 'skip', or a QuotaThrottle",
    )
    CLIENT_CLOCK = Message(
        Codes.W_CLIENT_CLOCK,
        "QUOTA['CLOCK'] is {clock!r}: counters follow this process's clock, bounded by "
        "MAX_CLOCK_REGRESSION; skewed clocks across hosts shift windows",
        "keep the default 'redis' clock unless tests inject time",
    )
    MIDDLEWARE_MISSING = Message(
        Codes.W_MIDDLEWARE_MISSING,
        "policies have routes but QuotaMiddleware is not in MIDDLEWARE: they apply only "
        "through throttles and decorators",
        "add {middleware!r} after AuthenticationMiddleware",
    )
    REDIS_EVICTS = Message(
        Codes.W_REDIS_EVICTS,
        "the Redis of node {node!r} has maxmemory-policy {policy} with maxmemory {maxmemory}: "
        "it can evict live counters, which resets their limits ({evicted} keys evicted since "
        "it started)",
        "set maxmemory-policy noeviction on the rate-limit Redis (CONFIG SET "
        "maxmemory-policy noeviction, and in its redis.conf), or give the counters a Redis "
        "of their own",
    )
    REDIS_URL_IGNORED = Message(
        Codes.W_REDIS_URL_IGNORED,
        "QUOTA['REDIS_URL'] is ignored because QUOTA['CACHE_ALIAS'] is set: the counters live "
        "in the Redis database of CACHES[{alias!r}], not at REDIS_URL",
        "remove QUOTA['REDIS_URL'], or remove QUOTA['CACHE_ALIAS'] to keep the counters at "
        "REDIS_URL (a database that cache.clear() does not flush)",
    )
