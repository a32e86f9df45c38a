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
    assert spec.openai_schema() == {
        "type": "function",
        "function": {"name": "search", "description": spec.description, "parameters": spec.parameters},
    }
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
    assert (
        spec.name == "lookup_v2" and spec.is_async and spec.timeout_s == 3.0 and spec.max_output_chars == 100
    )
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
    assert props["items"] == {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "note": {"type": "string"}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
    }
    assert props["meta"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert props["alt"] == props["note"]
    assert props["point"] == {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "integer"}],
        "minItems": 2,
        "maxItems": 2,
        "default": [0, 0],
    }
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


@pytest.mark.parametrize(
    ("make", "needle"),
    [
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
    ],
)
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


# ---- int parameters: only integral numbers, always delivered as int ------------------------------------------


@dataclass
class Stock:
    sku: str
    qty: int


class Line(TypedDict):
    qty: int
    ratio: float


def test_int_converters_turn_integral_floats_into_ints_at_every_depth():
    from miles.tools.schema import make_converter

    cases = [
        (int, 3.0, 3),
        (int, -0.0, 0),
        (int, 1e300, int(1e300)),
        (int, 7, 7),
        (list[int], [1.0, 2, -3.0], [1, 2, -3]),
        (dict[str, int], {"a": 4.0}, {"a": 4}),
        (Optional[int], 5.0, 5),  # noqa: UP045 - Optional spelled out on purpose
        (int | None, None, None),
        (tuple[int, str], [6.0, "x"], (6, "x")),
        (set[int], [1.0, 2.0], {1, 2}),
        (Stock, {"sku": "s", "qty": 2.0}, Stock("s", 2)),
        (Line, {"qty": 9.0, "ratio": 1}, {"qty": 9, "ratio": 1.0}),
        (list[Line], [{"qty": 1.0, "ratio": 2.5}], [{"qty": 1, "ratio": 2.5}]),
        (Literal[1, 2], 2.0, 2),
        (Literal[1.5, 2], 2.0, 2),
        (Literal[0.5, "a"], "a", "a"),
        (Annotated[int, "count"], 8.0, 8),
        (Priority, 2.0, Priority.HIGH),
    ]
    for tp, value, expected in cases:
        out = make_converter(tp)(value)
        assert out == expected, tp

        def types_of(x):
            if isinstance(x, dict):
                return {k: types_of(v) for k, v in x.items()}
            if isinstance(x, list | tuple | set):
                return [types_of(v) for v in sorted(x, key=repr)]
            if isinstance(x, Stock):
                return types_of(vars(x))
            return type(x)

        assert types_of(out) == types_of(expected), tp


def test_int_schema_admits_integral_numbers_only_and_never_bools():
    @tool
    def transfer(amount: int, splits: list[int]) -> str:
        """Move money.

        Args:
            amount: Whole units.
            splits: Whole units per part.
        """
        return ""

    spec = get_spec(transfer)
    assert spec.validation_errors({"amount": 30.0, "splits": [1.0, 2]}) == []
    assert spec.validation_errors({"amount": 30.5, "splits": []}) == [
        "at 'amount': 30.5 is not of type 'integer'"
    ]
    assert spec.validation_errors({"amount": True, "splits": [False]}) == [
        "at 'amount': True is not of type 'integer'",
        "at 'splits/0': False is not of type 'integer'",
    ]
    assert spec.validation_errors({"amount": float("nan"), "splits": [float("-inf")]}) == [
        "at 'amount': nan is not of type 'integer'",
        "at 'splits/0': -inf is not of type 'integer'",
    ]


def test_non_finite_numbers_are_violations_even_where_the_schema_allows_any_number():
    @tool
    def measure(x: float, extra: Any = None) -> str:
        """Measure.

        Args:
            x: A length.
            extra: Anything.
        """
        return ""

    spec = get_spec(measure)
    assert spec.validation_errors({"x": 1e308, "extra": {"a": [1.5]}}) == []
    assert spec.validation_errors({"x": float("inf"), "extra": {"a": [0.0, float("nan")]}}) == [
        "at 'extra/a/1': nan is not a finite number",
        "at 'x': inf is not a finite number",
    ]
