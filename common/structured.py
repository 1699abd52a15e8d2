"""What a request's output must match: a JSON schema, a regex, one of a set of strings,
or a grammar. ``StructuredOutput`` is the typed record carried inside ``SamplingParams``
from the gateway to every worker; compiling it into a token matcher is the engine's job.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StructuredKind(enum.Enum):
    JSON = "json"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec is empty
    REGEX = "regex"  # spec: the regular expression
    CHOICE = "choice"  # spec: a JSON array of the allowed strings
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    # The prompt's last this many tokens are output the constraint already matched: a
    # request the gateway moved to another worker carries its delivered tokens in the prompt.
    num_output_in_prompt: int = 0

    @property
    def key(self) -> tuple[StructuredKind, str]:
        """What the compiled grammar depends on."""
        return self.kind, self.spec
