"""`--compare NAME=V1,V2,...`: one fresh server per value, same workload, one table.

An engine option is passed to `conveyor serve` by its name with dashes, so any serve
flag works, including ones added after this file was written:

    max_num_seqs=4,8              -> ["--max-num-seqs", "4"], ["--max-num-seqs", "8"]
    enable_prefix_caching=true,false -> ["--enable-prefix-caching"], ["--no-enable-prefix-caching"]
    batching=static,continuous    -> ["--batching", "static"], ["--batching", "continuous"]

The values true/false (any case) become the --NAME / --no-NAME form of a boolean flag.
"""

from __future__ import annotations

from dataclasses import dataclass

_BOOLS = {"true": True, "false": False}


@dataclass(frozen=True)
class CompareSpec:
    """An engine option and the values to compare, in order (the first is the baseline)."""

    name: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> CompareSpec:
        """'name=v1,v2' -> CompareSpec. Dashes in the name are accepted as underscores.

        Raises ValueError without '=', with an empty name, fewer than 1 value, an empty or
        repeated value.
        """
        name, sep, rest = text.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"--compare {text!r}: expected NAME=V1,V2,... "
                             "(e.g. max_num_seqs=4,8)")
        values = tuple(v.strip() for v in rest.split(","))
        if not values or any(not v for v in values):
            raise ValueError(f"--compare {text!r}: empty value")
        if len(set(values)) != len(values):
            raise ValueError(f"--compare {text!r}: a value is repeated")
        return cls(name, values)

    def serve_args(self, value: str) -> list[str]:
        """The `conveyor serve` flags that set this option to `value`."""
        flag = "--" + self.name.replace("_", "-")
        b = _BOOLS.get(value.lower())
        if b is True:
            return [flag]
        if b is False:
            return ["--no-" + flag[2:]]
        return [flag, value]

    def label(self, value: str) -> str:
        return f"{self.name}={value}"
