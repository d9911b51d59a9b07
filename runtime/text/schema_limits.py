"""How large a JSON schema the grammar engine is given: checked on the schema before it is compiled, so that a
schema that passes compiles and runs inside the engine's own limits (`PARSER_LIMITS`) and never reaches native
code in a shape that can crash it (a chain of 1,000 `$ref`s overflows its stack; an object of 520 optional
properties without additional ones passes its 2,000 items a row mid-answer).

A schema's depth counts the nested schemas on a path, `$ref`s followed (a reference stands at its target's level;
one back to a schema on the path, recursion, is not followed again); its nodes count each schema object once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import K2Error


@dataclass(frozen=True)
class SchemaLimits:
    depth: int = 64  # nested schemas on a path, `$ref`s followed (OpenAI's structured outputs: 10 object levels;
    # the engine overflowed its stack at 1,000)
    properties: int = 256  # properties of one object (the engine's row limit allows about 500 optional ones)
    enum: int = 1024  # values of one enum (OpenAI: 1,000)
    nodes: int = 10_000  # schema objects in all


LIMITS = SchemaLimits()
# schema keywords whose value is a schema, a list of schemas or a map of names to schemas
ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems", "additionalItems")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaTooLarge(K2Error):
    """A schema past one of LIMITS: the request's fault (a 400 that names the limit)."""


# keys that constrain nothing: a schema of only these and a `$ref` is its reference and no more
BARE_KEYS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description"}


def check_schema(schema: object, what: str = "the schema", limits: SchemaLimits = LIMITS) -> None:
    """A SchemaTooLarge naming the first limit `schema` passes, else None."""
    Walk(schema, what, limits).schema(schema, 1, ())


class Walk:
    def __init__(self, root: object, what: str, limits: SchemaLimits):
        self.root, self.what, self.limits = root, what, limits
        self.seen: set[int] = set()  # schema objects counted
        self.depths: dict[str, int] = {}  # $ref -> the greatest depth it was followed from (none deeper repeats it)

    def refuse(self, problem: str) -> None:
        raise SchemaTooLarge(f"{self.what} {problem}; simplify it")

    def schema(self, node: object, depth: int, path: tuple[str, ...]) -> None:
        """Checks `node` at `depth`, reached through the `$ref`s in `path`."""
        if not isinstance(node, dict):
            return
        if depth > self.limits.depth:
            self.refuse(f"nests schemas more than {self.limits.depth} deep ($refs followed)")
        if id(node) not in self.seen:
            self.seen.add(id(node))
            if len(self.seen) > self.limits.nodes:
                self.refuse(f"has more than {self.limits.nodes} schemas in all")
            properties, enum = node.get("properties"), node.get("enum")
            if isinstance(properties, dict) and len(properties) > self.limits.properties:
                self.refuse(f"has an object of {len(properties)} properties (at most {self.limits.properties})")
            if isinstance(enum, list) and len(enum) > self.limits.enum:
                self.refuse(f"has an enum of {len(enum)} values (at most {self.limits.enum})")
        for key, value in node.items():
            children = ([value] if key in ONE else value if key in MANY and isinstance(value, list)
                        else list(value.values()) if key in NAMED and isinstance(value, dict) else [])
            for child in children:
                self.schema(child, depth + 1, path)
        ref = node.get("$ref")
        if isinstance(ref, str):
            self.no_bare_loop(ref)
        if isinstance(ref, str) and ref not in path and self.depths.get(ref, -1) < depth:
            self.depths[ref] = depth
            self.schema(self.resolve(ref), depth, (*path, ref))

    def no_bare_loop(self, ref: str) -> None:
        """A refusal where `ref` leads back to itself through schemas that say nothing but their own `$ref`: such a
        loop defines no value (an engine answers nothing and calls it done)."""
        chain = [ref]
        target = self.resolve(ref)
        while isinstance(target, dict) and isinstance(target.get("$ref"), str) and set(target) <= BARE_KEYS:
            chain.append(target["$ref"])
            if chain[-1] in chain[:-1]:
                raise SchemaTooLarge(f"{self.what} refers only to itself: {' -> '.join(chain)} leads back through "
                                     f"$refs alone and defines no value; give the reference a schema of its own")
            target = self.resolve(chain[-1])

    def resolve(self, ref: str) -> object:
        """A local reference (`#/$defs/name`, a JSON pointer into the root) -> its schema; None for any other
        (the engine says what it cannot resolve)."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in (p for p in ref[1:].split("/") if p):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node
