"""Schema derivation for @tool: types, docstrings, defaults, methods, Injected, definition errors."""

import enum
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired, Optional, TypedDict

import pytest
from jsonschema import Draft202012Validator

from miles.tools import Injected, ToolDefinitionError, ToolSpec, collect_tools, get_spec, tool


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass
class Address:
    """A postal address.

    Attributes:
        street: Street and number.
        city: City name.
    """

    street: str
    city: str
    zip_code: str = "00000"
    tags: list[str] = field(default_factory=list)


class Item(TypedDict):
    sku: str
    qty: int
    note: NotRequired[str]


def test_primitives_and_google_docstring():
    @tool
    def search(query: str, limit: int, ratio: float, exact: bool) -> str:
        """Search the catalogue.

        Longer explanation here.

        Args:
            query: What to look for.
            limit: Maximum number of hits.
            ratio (float): Fuzzy ratio.
            exact: Only exact matches.
        """
        return query

    spec = search.__miles_tool__
    assert isinstance(spec, ToolSpec)
    assert spec.name == "search"
    assert spec.description == "Search the catalogue.\n\nLonger explanation here."
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"type": "integer", "description": "Maximum number of hits."},
            "ratio": {"type": "number", "description": "Fuzzy ratio."},
            "exact": {"type": "boolean", "description": "Only exact matches."},
        },
        "required": ["query", "limit", "ratio", "exact"],
        "additionalProperties": False,
    }
    assert spec.openai_schema() == {"type": "function", "function": {
        "name": "search", "description": spec.description, "parameters": spec.parameters}}
    assert not spec.is_async and spec.injected == ()
    assert search("x", 1, 0.5, True) == "x"  # the decorated function stays callable


def test_numpy_docstring_and_defaults():
    @tool(name="lookup_v2", timeout_s=3.0, max_output_chars=100)
    async def lookup(key: str, retries: int = 2, mode: Literal["fast", "slow"] = "fast") -> str:
        """Look a key up.

        Parameters
        ----------
        key : str
            The key.
        retries : int
            How often to retry.
        """
        return key

    spec = get_spec(lookup)
    assert spec.name == "lookup_v2" and spec.is_async and spec.timeout_s == 3.0 and spec.max_output_chars == 100
    assert spec.parameters["required"] == ["key"]
    assert spec.parameters["properties"] == {
        "key": {"type": "string", "description": "The key."},
        "retries": {"type": "integer", "description": "How often to retry.", "default": 2},
        "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
    }


def test_complex_types():
    @tool
    def place(
        color: Color,
        priority: Priority,
        address: Address,
        items: list[Item],
        meta: dict[str, int],
        note: Optional[str] = None,  # noqa: UP045 - Optional spelled out on purpose
        alt: str | None = None,
        point: tuple[int, int] = (0, 0),
        anything: Any = None,
        level: Annotated[int, "Level from 1 to 5."] = 1,
        mixed: Literal[1, "a"] = 1,
        labels: set[str] | None = None,
    ) -> str:
        """Place an order.

        Args:
            level: Ignored, the Annotated text wins.
        """
        return ""

    props = place.__miles_tool__.parameters["properties"]
    assert props["color"] == {"type": "string", "enum": ["red", "green"]}
    assert props["priority"] == {"type": "integer", "enum": [1, 2]}
    assert props["address"] == {
        "type": "object",
        "properties": {
            "street": {"type": "string", "description": "Street and number."},
            "city": {"type": "string", "description": "City name."},
            "zip_code": {"type": "string", "default": "00000"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["street", "city"],
        "additionalProperties": False,
        "title": "Address",
        "description": "A postal address.",
    }
    assert props["items"] == {"type": "array", "items": {
        "type": "object",
        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["sku", "qty"], "additionalProperties": False}}
    assert props["meta"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["alt"] == props["note"]
    assert props["point"] == {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}],
                              "minItems": 2, "maxItems": 2, "default": [0, 0]}
    assert props["anything"] == {"default": None}
    assert props["level"] == {"type": "integer", "description": "Level from 1 to 5.", "default": 1}
    assert props["mixed"] == {"enum": [1, "a"], "default": 1}
    assert props["labels"]["anyOf"][0] == {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    Draft202012Validator.check_schema(place.__miles_tool__.parameters)


class Shop:
    def __init__(self, stock: dict[str, int]):
        self.stock = stock

    @tool
    def check(self, sku: str) -> int:
        """Units in stock.

        Args:
            sku: Product id.
        """
        return self.stock.get(sku, 0)

    def helper(self) -> None:
        """Not a tool."""

    @tool
    async def reserve(self, sku: str, qty: int, db: Injected[dict]) -> str:
        """Reserve units.

        Args:
            sku: Product id.
            qty: Units.
            db: The injected database (hidden from the model).
        """
        return "ok"


class BigShop(Shop):
    @tool
    def check(self, sku: str) -> int:
        """Units in stock, overridden.

        Args:
            sku: Product id.
        """
        return 99

    @tool
    def extra(self) -> str:
        """An extra tool without arguments."""
        return "extra"


def test_methods_skip_self_and_hide_injected():
    spec = get_spec(Shop.reserve)
    assert spec.takes_self and spec.injected == ("db",)
    assert list(spec.parameters["properties"]) == ["sku", "qty"]
    assert spec.parameters["required"] == ["sku", "qty"]
    shop = Shop({"a": 3})
    tools = collect_tools(shop)
    assert [t.__name__ for t in tools] == ["check", "reserve"]
    assert tools[0]("a") == 3 and get_spec(tools[0]).name == "check"
    big = collect_tools(BigShop({}))
    assert [t.__name__ for t in big] == ["check", "reserve", "extra"]
    assert big[0]("x") == 99
    assert get_spec(big[2]).parameters == {"type": "object", "properties": {}, "additionalProperties": False}


def _nope(*args: int) -> None:
    """Varargs."""


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: tool(_no_doc), "tool '_no_doc' has no description"),
    (lambda: tool(lambda x: x), "tool name '<lambda>' must match"),
    (lambda: tool(_nope), "*args cannot be described"),
    (lambda: tool(_missing_annotation), "parameter 'x': missing type annotation"),
    (lambda: tool(_kwargs), "**kw cannot be described"),
    (lambda: tool(_bad_type), "cannot derive a JSON schema for type"),
    (lambda: tool(_int_keys), "dict keys must be str"),
    (lambda: tool(_undocumented_doc), "documents unknown parameter(s) ['y']"),
    (lambda: tool(_missing_annotation, name="bad name!"), "must match"),
    (lambda: tool(_ok, timeout_s=0), "timeout_s must be positive"),
    (lambda: tool(_recursive), "recursive type Node"),
    (lambda: tool(_generator), "generator functions cannot be tools"),
])
def test_undescribable_tools_fail_at_definition(make, needle):
    with pytest.raises(ToolDefinitionError) as info:
        make()
    assert needle in str(info.value)


def _no_doc(x: int) -> None:
    pass


def _missing_annotation(x) -> None:
    """No annotation."""


def _kwargs(a: int, **kw: int) -> None:
    """Kwargs."""


class Opaque:
    pass


def _bad_type(x: Opaque) -> None:
    """Opaque type."""


def _int_keys(x: dict[int, str]) -> None:
    """Int keys."""


def _undocumented_doc(x: int) -> None:
    """Doc mentions a parameter that does not exist.

    Args:
        x: Exists.
        y: Does not.
    """


def _ok(x: int) -> None:
    """Fine."""


@dataclass
class Node:
    value: int
    child: "Node | None" = None


def _recursive(n: Node) -> None:
    """Recursive."""


def _generator(n: int):  # noqa: ANN202
    """Generator."""
    yield n
