"""The one syntax of a fault spec, shared by `ftrun launch --inject`, `ftrun emulate --inject` and the
profiles' event tables: `VERB [NOUN] key=value ...`, e.g. `kill replica=1 step=5`, `slow fetch replica=1
delay=0.2`. Each environment passes the forms it can inject; what a form means is its own (pure, no I/O)."""

from __future__ import annotations

import re

Form = tuple[str, "str | None"]
FIELD = re.compile(r"([a-z]+)=(\S+)")


def split(text: str, forms: dict[Form, tuple[set[str], set[str]]]) -> tuple[Form, dict[str, str]]:
    """(form, fields) of one spec; `forms` maps (verb, noun or None) -> (required fields, optional fields).
    Raises ValueError naming the unknown form, a bad or repeated field, or missing / unknown fields."""
    words = text.split()
    if not words:
        raise ValueError("empty")
    noun = words[1] if len(words) > 1 and "=" not in words[1] else None
    form = (words[0], noun)
    if form not in forms:
        raise ValueError(f"unknown fault {' '.join(w for w in form if w)!r}")
    fields: dict[str, str] = {}
    for word in words[2 if noun else 1:]:
        m = FIELD.fullmatch(word)
        if m is None or m.group(1) in fields:
            raise ValueError(f"bad or repeated field {word!r}")
        fields[m.group(1)] = m.group(2)
    required, optional = forms[form]
    missing, unknown = sorted(required - fields.keys()), sorted(fields.keys() - required - optional)
    if missing or unknown:
        raise ValueError(f"missing {missing} / unknown {unknown} fields")
    return form, fields
