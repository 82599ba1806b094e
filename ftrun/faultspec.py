"""The one fault grammar, shared by `ftrun launch --inject`, `ftrun emulate --inject` and the profiles'
`[failures] events` (a list of these strings): `VERB [NOUN] key=value ...`. One table of forms (FORMS), the
same nouns and meanings in both environments; each environment injects a subset and rejects the rest with a
clear error (`parse(text, env)`). Pure, no I/O.

Targets: `replica=R` (every rank of replica R) or `replica=R rank=K` (rank K of replica R, or the host that
runs it); `host=H` (a training host by index or name: the emulator's topology only); `building=B`.
When: `step=S` (the replica committed step S, or the job is past it) plus `at=F` x the step's compute
(at=ftar: as the replica enters the step's all-reduce), or `time=T` seconds after the job started.

The three failures, meaning the same thing for real and emulated (issue 11 item 8):
    kill   a process crash: SIGKILL, its connections reset at once, peers see it immediately
    hang   the process stops (SIGSTOP): nothing is reset, peers wait for their own timeouts
    cut    a host loss: silence (a network cut: no reset, no heartbeat) until a timeout says so
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ENVS = ("launch", "emulate")
FIELD = re.compile(r"([a-z]+)=(\S+)")


@dataclass(frozen=True)
class Form:
    verb: str
    noun: str | None
    required: frozenset[str]
    optional: frozenset[str]
    envs: frozenset[str]  # the environments that inject it
    usage: str
    meaning: str

    @property
    def name(self) -> str:
        return f"{self.verb} {self.noun}" if self.noun else self.verb


def _form(usage: str, required: str, optional: str, envs: str, meaning: str) -> Form:
    words = usage.split()
    noun = words[1] if len(words) > 1 and "=" not in words[1] and not words[1].startswith("[") else None
    return Form(words[0], noun, frozenset(required.split()), frozenset(optional.split()),
                frozenset(envs.split()), usage, meaning)


FORMS: tuple[Form, ...] = (
    _form("kill replica=R [rank=K] step=S|time=T [at=F|ftar] [hosts=relaunch|replace]", "replica",
          "rank step time at hosts", "launch emulate",
          "a process crash (SIGKILL): every rank of replica R, or its rank K; connections reset at once; the "
          "replica is restarted (hosts=replace: on spare hosts, emulator)"),
    _form("kill lighthouse step=S|time=T [at=F] [down=D]", "", "step time at down", "emulate",
          "the lighthouse process crashes and restarts D seconds later from its persisted state"),
    _form("hang replica=R [rank=K] | host=H  step=S|time=T [at=F] [duration=D]", "",
          "replica rank host step time at duration", "launch emulate",
          "the process stops (SIGSTOP): every rank of replica R, its rank K, or every process of host H; "
          "resumed after D seconds (default: never; a release ends it too, emulator)"),
    _form("cut replica=R [rank=K] | building=B  step=S|time=T [at=F] [duration=D]", "",
          "replica rank building step time at duration", "launch emulate",
          "a host loss: the hosts of replica R (the host of its rank K), or building B, go silent (no reset, no "
          "heartbeat) for D seconds (default: for good)"),
    _form("slow host replica=R [rank=K] factor=F [step=S]", "replica factor", "rank step", "emulate",
          "a straggler: the host of rank K (default 0) of replica R computes F x slower from step S on"),
    _form("slow host=H factor=X [time=T] [duration=D]", "host factor", "time duration", "emulate",
          "host H computes X x slower until a release (or D seconds)"),
    _form("slow link a=H b=H factor=X [time=T] [duration=D]", "a b factor", "time duration", "emulate",
          "frames between hosts A and B move X x slower until a release (or D seconds)"),
    _form("slow fetch replica=R [factor=F] [delay=D]", "replica", "factor delay", "launch emulate",
          "replica R's state fetches (catch-up) take F x their transfer time plus D seconds"),
    _form("release [time=T]", "", "time", "emulate", "every hang is released and every scenario slowness restored"),
)
ENV_NAMES = {"launch": "`ftrun launch`", "emulate": "`ftrun emulate`"}


def usage(env: str | None = None) -> str:
    """The forms `env` injects (every form: None), for error messages."""
    return "expected one of: " + ", ".join(f'"{f.usage}"' for f in FORMS if env is None or env in f.envs)


def _find(words: list[str]) -> tuple[Form, int]:
    """The form of a spec's words and how many words name it. `slow host=H` is the one form whose first
    field stands in for a noun."""
    noun = words[1] if len(words) > 1 and "=" not in words[1] else None
    if words[0] == "slow" and noun is None and len(words) > 1 and not words[1].startswith("host="):
        raise ValueError(f"unknown fault 'slow {words[1]}'")
    matches = [f for f in FORMS if f.verb == words[0] and f.noun == noun]
    if not matches:
        raise ValueError(f"unknown fault {' '.join(w for w in (words[0], noun) if w)!r}")
    return matches[0], 2 if noun else 1


@dataclass(frozen=True)
class Spec:
    form: Form
    fields: dict[str, str]

    @property
    def key(self) -> tuple[str, str | None]:
        return self.form.verb, self.form.noun

    def num(self, key: str, default: Any = None) -> Any:
        """The field as a float (`default` when absent); ValueError if it is not a number."""
        return float(self.fields[key]) if key in self.fields else default

    def int(self, key: str, default: Any = None) -> Any:
        return int(self.fields[key]) if key in self.fields else default

    def has(self, *keys: str) -> bool:
        return any(k in self.fields for k in keys)


def parse(text: str, env: str | None = None) -> Spec:
    """The form and fields of one spec. With `env`, a form that environment cannot inject is rejected.
    Raises ValueError naming the unknown form, a bad or repeated field, missing / unknown fields, or the
    environment that cannot inject the form (with the forms it can)."""
    words = text.split()
    if not words:
        raise ValueError("empty")
    form, skip = _find(words)
    if env is not None and env not in form.envs:
        where = " and ".join(ENV_NAMES[e] for e in sorted(form.envs))
        raise ValueError(f"{ENV_NAMES[env]} cannot inject {form.name!r} (only {where} can)")
    fields: dict[str, str] = {}
    for word in words[skip:]:
        m = FIELD.fullmatch(word)
        if m is None or m.group(1) in fields:
            raise ValueError(f"bad or repeated field {word!r}")
        fields[m.group(1)] = m.group(2)
    missing, unknown = sorted(form.required - fields.keys()), sorted(fields.keys() - form.required - form.optional)
    if missing or unknown:
        raise ValueError("; ".join([f"missing fields: {', '.join(missing)}"] * bool(missing)
                                   + [f"unknown fields: {', '.join(unknown)}"] * bool(unknown)))
    return Spec(form, fields)


def one_target(spec: Spec, *targets: str) -> str:
    """The one of `targets` the spec names (ValueError if none or several)."""
    named = [t for t in targets if t in spec.fields]
    if len(named) != 1:
        raise ValueError(f"{spec.form.name} needs exactly one of {' or '.join(t + '=' for t in targets)}")
    if "rank" in spec.fields and named[0] != "replica":
        raise ValueError("rank= goes with replica=")
    return named[0]


def refuse(spec: Spec, env: str, *keys: str, why: str = "") -> None:
    """ValueError if the spec uses one of `keys` (fields, or `key=value`), which `env` cannot inject."""
    for key in keys:
        name, _, value = key.partition("=")
        if name in spec.fields and (not value or spec.fields[name] == value):
            raise ValueError(f"{ENV_NAMES[env]} cannot inject {spec.form.name} with {key}{'' if value else '...'}"
                             + (f" ({why})" if why else ""))
