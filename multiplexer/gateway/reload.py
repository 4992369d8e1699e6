"""Config reload without a restart: ``SIGHUP`` and ``POST /admin/reload`` read the config file again.

What a call is routed by (routes, model groups, fallbacks, providers and their limits, the
config's keys and teams, ``server.quotas``, prices and ``budgets:``) is swapped in one step on
the event loop, with no await between the first assignment and the last: a call admitted before
the step runs on what admitted it (its ticket holds its route, its lane and through it the
provider and limiter), one admitted after sees the new config, and the hot path reads the same
attributes it always did, so it pays nothing. A provider whose settings did not change is kept
as it is (its sessions, pools and local models untouched, its lanes too where their route did not
change). One whose settings changed is started beside the old one before the step; the old one's
lanes stop taking calls and run what they hold, and the provider is closed once they have
drained. A file that does not validate, or fails what ``multiplexer check-config`` checks, is
refused with the same lines, and the running config stays; so is one whose new provider fails to
start. What the file says that only a restart applies (the address, the store, the state, the
dashboard, ...) is kept as running and named in the answer's ``restart_needed``.

Each reload is counted (``multiplexer_config_reloads_total{result}``) and, where the key store
is open, written as an audit row (action ``config.reload``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import yaml
from prometheus_client import Counter

from multiplexer.core.lane import Lane
from multiplexer.core.limiter import Limiter
from multiplexer.core.policy import ProviderConfig, RouteConfig
from multiplexer.core.provider import BatchCapable, Provider
from multiplexer.core.router import Router
from multiplexer.core.shared_limiter import SharedLimiter
from multiplexer.gateway.config import Config, ConfigError, ServerConfig, parse_config
from multiplexer.gateway.fallbacks import breaker_policies
from multiplexer.gateway.gateway import with_kind_defaults
from multiplexer.gateway.provider_life import ProviderLife
from multiplexer.gateway.registry import provider_class
from multiplexer.gateway.replicas import limiter_for
from multiplexer.money.prices import Prices

if TYPE_CHECKING:
    from multiplexer.gateway.gateway import Gateway

log = logging.getLogger(__name__)

Result = Literal["ok", "invalid", "failed"]
# what a reload applies; everything else in the file waits for a restart
RELOADED = ("providers", "routes", "groups", "budgets")
SERVER_RELOADED = ("api_keys", "teams", "quotas")
# sections applied at once but for the keys named (those wait for a restart): the request log's
# and the tool-call audit's settings are read again (their writers and the MCP faces' wrapping
# stay as they started)
PARTLY_RELOADED = {"log": ("enabled",), "audit": ("tools",)}
# set from the command line, not only the file (``--workers``, a worker's slot): never compared
SERVER_UNCOMPARED = ("workers",)
# a provider's keys that reach new calls without starting it again (read through ``Prices``)
PRICE_KEYS = frozenset({"price", "batch_discount"})
START_TIMEOUT_S = 120.0  # a new provider slower than this to start fails the reload
HOOKS = "reload_hooks"  # gateway.faces key: what faces rebuild from the new config


@dataclass
class Reloaded:
    """What one reload did, as ``POST /admin/reload`` answers it."""

    result: Result
    errors: list[str] = field(default_factory=list)
    routes: dict[str, list[str]] = field(default_factory=dict)  # added, removed, changed
    providers: dict[str, list[str]] = field(default_factory=dict)  # started, draining, kept
    restart_needed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"result": self.result, "seconds": round(self.seconds, 4)}
        if self.errors:
            out["errors"] = self.errors
        if self.result == "ok":
            out.update(routes=self.routes, providers=self.providers, restart_needed=self.restart_needed)
        return out


def on_reload(gateway: Any, hook: Callable[[Config], None]) -> None:
    """A face's state built from the config (``/v1``'s model names, the YAML keys' digests) is
    rebuilt by ``hook(new_config)``, called inside the swap (no await: on the event loop)."""
    gateway.faces.setdefault(HOOKS, []).append(hook)


def _same_provider(old: ProviderConfig, new: ProviderConfig) -> bool:
    """Whether a provider may be kept as it runs: its settings equal but for its prices."""
    return old.model_dump(exclude=set(PRICE_KEYS)) == new.model_dump(exclude=set(PRICE_KEYS))


def _own_lane(route: RouteConfig) -> bool:
    """A route with a lane of its own (``Gateway._lane_for``'s rule)."""
    return route.batch is not None or route.mode == "batch"


def restart_needed(old: Config, new: Config) -> list[str]:
    """The keys whose new values only a restart applies, where the file changed them."""
    out = [name for name in type(old).model_fields
           if name not in RELOADED and name not in ("server", "cache") and name not in PARTLY_RELOADED
           and getattr(old, name) != getattr(new, name)]
    out += [f"{section}.{key}" for section, keys in PARTLY_RELOADED.items() for key in keys
            if getattr(getattr(old, section), key) != getattr(getattr(new, section), key)]
    if old.cache.max_entries != new.cache.max_entries:  # cache.semantic is reloaded
        out.append("cache.max_entries")
    out += [f"server.{name}" for name in ServerConfig.model_fields
            if name not in SERVER_RELOADED and name not in SERVER_UNCOMPARED
            and getattr(old.server, name) != getattr(new.server, name)]
    return sorted(out)


def merged(old: Config, new: Config) -> Config:
    """The running config with what a reload applies taken from ``new``."""
    server = old.server.model_copy(update={k: getattr(new.server, k) for k in SERVER_RELOADED})
    cache = old.cache.model_copy(update={"semantic": new.cache.semantic})  # the semantic cache's
    partly = {section: getattr(new, section).model_copy(  # log:, audit: but for the keys named
        update={key: getattr(getattr(old, section), key) for key in keys})
        for section, keys in PARTLY_RELOADED.items()}
    config = old.model_copy(update={"server": server, "cache": cache, **partly,
                                    **{k: getattr(new, k) for k in RELOADED}})
    config.providers = dict(new.providers)  # completed below with each kind's defaults
    return config


def _diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[str]]:
    return {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new)),
            "changed": sorted(n for n in set(old) & set(new) if old[n] != new[n])}


class ConfigReloader:
    """One gateway's reloads, one at a time; ``path``: its config file (None: built in code)."""

    def __init__(self, gateway: Gateway, path: Path | None,
                 wall: Callable[[], float] = time.time) -> None:
        self.gw = gateway
        self.path = path
        self.wall = wall
        # the composer's checks of a new config (raise ConfigError): the bound address still
        # needs a key of its callers, as at start (``server.check_bind``)
        self.checks: list[Callable[[Config], None]] = []
        self._lock = anyio.Lock()
        self._retired = 0  # lanes retired so far (their keys in gateway.lanes while they drain)
        self.draining: set[str] = set()  # providers whose lanes are still running what they hold
        self.finished = 0  # reloads ended, whatever their result
        self._moved: anyio.Event | None = None  # set when a reload ends or a provider drains
        self.reloads = Counter("multiplexer_config_reloads", "Config reloads (SIGHUP, POST "
                               "/admin/reload) by result: ok, invalid (refused: the running config "
                               "stays) or failed (a new provider did not start)", ["result"],
                               registry=gateway.metrics.registry)
        for result in ("ok", "invalid", "failed"):
            self.reloads.labels(result)

    async def reload(self, actor: str = "sighup") -> Reloaded:
        """Read the file again and apply it; the answer says what changed or why not. Shielded:
        a caller that goes away never leaves a reload half done."""
        started = time.perf_counter()
        with anyio.CancelScope(shield=True):
            async with self._lock:
                try:
                    done = await self._reload()
                except Exception as e:  # a bug here must not end the gateway (SIGHUP's task is its own)
                    log.exception("config reload failed inside the gateway")
                    done = Reloaded("failed", [f"internal error: {type(e).__name__}"])
            done.seconds = time.perf_counter() - started
            self.reloads.labels(done.result).inc()
            if done.result == "ok":
                log.info("config reloaded from %s (%s): routes %s, providers %s%s", self.path, actor,
                         done.routes, done.providers,
                         f"; restart needed for {', '.join(done.restart_needed)}"
                         if done.restart_needed else "")
            else:
                log.warning("config reload %s (%s): %s", done.result, actor, " ".join(done.errors))
            await self._audit(actor, done)
            self.finished += 1
            self._tick()
        return done

    def _tick(self) -> None:
        moved, self._moved = self._moved, None
        if moved is not None:
            moved.set()

    async def wait_until(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` holds, looked at again as each reload ends and each provider drains
        (tests, and whoever waits on a reload it did not start: a SIGHUP's)."""
        while not done():
            if self._moved is None:
                self._moved = anyio.Event()
            await self._moved.wait()

    async def _audit(self, actor: str, done: Reloaded) -> None:
        store = self.gw.keys.store
        if store is None:  # no key store opened: the log line above is the record
            return
        from multiplexer.access.keystore import AuditRow

        detail = {k: v for k, v in done.as_json().items() if k != "seconds"}
        if self.path is not None:
            detail["path"] = str(self.path)
        row = AuditRow(uuid.uuid4().hex, self.wall(), actor, "config.reload", "config", detail)
        try:
            await store.run(store.record, row)
        except Exception as e:  # the reload stands; its row is what is lost
            log.warning("config reload: audit row not written: %s", str(e).splitlines()[0][:200])

    async def _reload(self) -> Reloaded:
        if self.path is None:
            return Reloaded("failed", ["this gateway's config was not read from a file"])
        if self.gw.closing:
            return Reloaded("failed", ["the gateway is stopping"])
        try:
            new = await anyio.to_thread.run_sync(self._read, self.path)
        except ConfigError as e:
            return Reloaded("invalid", [line.strip() for line in str(e).splitlines()])
        gw = self.gw
        old = gw.config
        config = merged(old, new)
        try:
            for check in self.checks:
                check(config)
        except ConfigError as e:
            return Reloaded("invalid", [line.strip() for line in str(e).splitlines()])
        started: dict[str, tuple[Provider, Limiter, ProviderLife]] = {}
        kept: list[str] = []
        try:
            for name, pconf in new.providers.items():
                cls = provider_class(pconf.kind)
                pconf = config.providers[name] = with_kind_defaults(pconf, cls)
                running = old.providers.get(name)
                if running is not None and name in gw.providers and _same_provider(running, pconf):
                    kept.append(name)
                    continue
                started[name] = await self._start(name, pconf, cls, config)
        except Exception as e:
            for _, _, life in started.values():
                await gw.lives.close(life)
            what = f"providers.{name}: did not start: {type(e).__name__}: {e}"
            return Reloaded("failed", [what])
        done = Reloaded("ok", restart_needed=restart_needed(old, new))
        done.routes = _diff(old.routes, config.routes)
        self._swap(old, config, started, kept, done)
        return done

    @staticmethod
    def _read(path: Path) -> Config:
        """The file validated, then what ``check-config`` checks: the same lines it prints."""
        from multiplexer.gateway.config_checks import problems

        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        if not text.strip():  # a file being written (truncated first): never "no routes at all"
            raise ConfigError(f"invalid config:\n  {path} is empty (write the new file beside it "
                              "and rename it over the old, so a reload never reads it half written)")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        config = parse_config(data, base_dir=path.parent)
        config._source = path
        lines = problems(config)
        if lines:
            raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
        return config

    async def _start(self, name: str, pconf: ProviderConfig, cls: type[Provider],
                     config: Config) -> tuple[Provider, Limiter, ProviderLife]:
        """A provider built and started as the gateway starts its own, in a task of its own that
        also closes it (``gateway/provider_life.py``: a provider may hold task groups, exited in
        the task that entered them)."""
        gw = self.gw
        limiter = limiter_for(name, pconf, gw.clock, gw.state, gw.metrics, gw.share)
        provider = cls(gw.provider_context(name, pconf, cls, limiter, config))
        life = await gw.lives.start(provider, START_TIMEOUT_S)
        return provider, limiter, life

    def _swap(self, old: Config, config: Config, started: dict[str, tuple[Provider, Limiter, ProviderLife]],
              kept: list[str], done: Reloaded) -> None:
        """The one step (no await): every reference admission reads, replaced together."""
        gw = self.gw
        gone = [n for n in old.providers if n not in kept]  # changed or removed: drained
        lanes: dict[tuple[str, str | None], Lane] = {}
        retired: list[Lane] = []
        for key, lane in gw.lanes.items():
            provider, route = key
            if route is not None and route.startswith("\0"):  # retired by an earlier reload
                lanes[key] = lane
                continue
            stays = provider in kept and (route is None or (
                route in config.routes and config.routes[route] == old.routes.get(route)
                and _own_lane(config.routes[route])))
            if stays:
                lanes[key] = lane
            else:
                self._retired += 1
                lanes[(provider, f"\0retired-{self._retired}")] = lane
                retired.append(lane)
        old_providers = {n: gw.providers[n] for n in gone if n in gw.providers}
        old_limiters = {n: gw.limiters[n] for n in gone if n in gw.limiters}
        gw.providers = {**{n: gw.providers[n] for n in kept}, **{n: p for n, (p, _, _) in started.items()}}
        gw.limiters = {**{n: gw.limiters[n] for n in kept}, **{n: lim for n, (_, lim, _) in started.items()}}
        gw.lanes = lanes
        gw.config = config
        gw.router = Router(config.routes, {g: c.routes for g, c in config.groups.items()})
        self._fallbacks(old, config)
        self._keys(old, config)
        self._semantic(config)
        if gw.requests is not None:
            gw.requests.reconfigure(config.log)
        self._route_options(old, config, kept)
        if gw.money is not None:
            prices = Prices(config.providers, config.routes)
            gw.money.meter.prices = gw.money.budgets.prices = prices
            gw.money.budgets.config = config.budgets
        for hook in list(gw.faces.get(HOOKS, ())):
            try:
                hook(config)
            except Exception:  # one face's bug: the others and the gateway take the new config
                log.exception("a face did not take the reloaded config")
        for name, (_, limiter, _) in started.items():
            gw.started.add(name)
            if isinstance(limiter, SharedLimiter):
                gw.start_background(limiter.run)
        for rname, rconf in config.routes.items():
            gw._lane_for(rname, rconf)
        for lane in retired:
            lane.close()
        lives = {n: life for n, p in old_providers.items() for life in gw.lives.open if life.provider is p}
        done.providers = {"started": sorted(started), "draining": sorted(gone), "kept": sorted(kept)}
        if any(done.routes.values()) or started or gone:  # MCP clients list the tools again
            gw.notify("tools_changed", {"provider": None, "reason": "config reload"})
            if started or gone:
                gw.notify("resources_changed", {"provider": None, "reason": "config reload"})
                gw.notify("prompts_changed", {"provider": None, "reason": "config reload"})
        if retired or old_providers:
            self.draining.update(old_providers)
            gw.start_background(self._drain, retired, old_providers, old_limiters, lives)

    def _fallbacks(self, old: Config, config: Config) -> None:
        """Fallbacks, model groups and breakers read the new routes; breakers' states, busy counts
        and latencies carry on."""
        fb = self.gw.fallbacks
        policies = breaker_policies(config)
        for name in list(fb.breakers.all):
            if name in old.providers and policies.get(name) is None and not (
                    old.providers[name].extra.get("base_urls")):
                fb.breakers.all.pop(name, None)
        for name, policy in policies.items():
            current = fb.breakers.get(name)
            if current is None or old.providers.get(name) is None or old.providers[name].breaker != policy:
                fb.breakers.add(name, policy)
                self.gw.metrics.breaker_state.labels(name).set(0)
        fb.read_config(config, policies)

    def _semantic(self, config: Config) -> None:
        """``cache.semantic`` for new calls (``SemanticCache.configure``: answers kept where their
        scope is unchanged); one turned on by the reload starts now. Turned off, the cache stays
        with nothing to cache (its metrics registered once)."""
        gw = self.gw
        section = config.cache.semantic
        if gw.semantic is not None:
            gw.semantic.configure(section, {g: c.routes for g, c in config.groups.items()})
        elif section.enabled:
            from multiplexer.gateway.semantic import run_semantic, semantic_for

            gw.semantic = semantic_for(gw)
            if gw.semantic is not None:
                gw.start_background(run_semantic, gw.semantic)

    def _route_options(self, old: Config, config: Config, kept: list[str]) -> None:
        """What a kept provider built from a route's own keys on the route's first call (an MCP
        upstream's route ``tool_limits``, ``providers/mcp_limits.ToolLimits``) is forgotten for
        each route changed or removed, and built again from the new keys on its next call (a
        changed provider is started anew and reads them fresh)."""
        changed = [name for name, route in old.routes.items() if config.routes.get(name) != route]
        if not changed:
            return
        for name in kept:
            provider = self.gw.providers.get(name)
            if provider is not None:
                provider.routes_changed(changed)

    def _keys(self, old: Config, config: Config) -> None:
        """The config's keys, teams and ``server.quotas``: their rules and limits for new calls
        (slots held stay held and are released as usual)."""
        gw = self.gw
        before, after = old.server.quotas, config.server.quotas
        for name in set(before) - set(after):
            gw.quotas.set_limits(name, None)
        for name, quota in after.items():
            gw.quotas.set_limits(name, quota)
        gw.keys.configure(config.server.api_keys, config.server.teams, set(after))

    async def _drain(self, lanes: list[Lane], providers: dict[str, Provider],
                     limiters: dict[str, Limiter], lives: dict[str, ProviderLife]) -> None:
        """The retired lanes run what they hold, then leave; then the providers they served close,
        in their own tasks, whether the gateway or a reload started them (but one with a batch
        API, whose remote batch jobs may still run: that one closes with the gateway)."""
        for lane in lanes:
            await lane.drained.wait()
        gw = self.gw
        gw.lanes = {k: v for k, v in gw.lanes.items() if not any(v is lane for lane in lanes)}
        for name in providers:
            limiter = limiters.get(name)
            if isinstance(limiter, SharedLimiter):
                with anyio.move_on_after(2.0):
                    await limiter.drain()
            life = lives.get(name)
            if life is not None and isinstance(providers[name], BatchCapable):
                life = None  # its remote batch jobs run on: it closes with the gateway
            if life is not None:
                await gw.lives.close(life)
            self.draining.discard(name)
            self._tick()
            log.info("provider %s: its old settings drained%s", name,
                     " and closed" if life is not None else " (closed when the gateway stops)")
