"""The tool parameter schemas the tool-call tests share: a bounded weather query and a unit
switch, small enough for a random-weight model under a grammar to finish."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
UNITS = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "set_unit": UNITS}
