"""Regenerate the shipped data files in `envs/data/` (fixed seed, so the output is byte-identical).

python -m miles.envs.datagen            # rewrite the files
python -m miles.envs.datagen --check    # exit 1 if the shipped files differ
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import sys
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SEED = 20240601

FIRST = [
    "Ada",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kira",
    "Luis",
    "Maya",
    "Nikhil",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
    "Zoe",
    "Amir",
    "Bea",
    "Carlos",
    "Dana",
    "Emil",
]
LAST = [
    "Novak",
    "Okafor",
    "Silva",
    "Tanaka",
    "Weber",
    "Kowalski",
    "Haddad",
    "Larsen",
    "Moreau",
    "Patel",
    "Rossi",
    "Schmidt",
    "Ivanova",
    "Nguyen",
    "Garcia",
    "Dubois",
    "Fischer",
    "Kim",
    "Lopez",
    "Berg",
]
DEPARTMENTS = [
    ("Engineering", "Berlin", 2_400_000),
    ("Sales", "London", 1_300_000),
    ("Marketing", "Paris", 900_000),
    ("Finance", "Zurich", 750_000),
    ("Human Resources", "Berlin", 420_000),
    ("Operations", "Warsaw", 1_100_000),
    ("Support", "Lisbon", 610_000),
    ("Legal", "Zurich", 530_000),
]
TITLES = {
    "Engineering": ["Engineer", "Senior Engineer", "Staff Engineer"],
    "Sales": ["Account Executive", "Sales Manager"],
    "Marketing": ["Marketer", "Marketing Lead"],
    "Finance": ["Analyst", "Controller"],
    "Human Resources": ["Recruiter", "HR Partner"],
    "Operations": ["Coordinator", "Operations Manager"],
    "Support": ["Agent", "Support Lead"],
    "Legal": ["Counsel", "Paralegal"],
}
PRODUCTS = [
    ("Widget", 25.0),
    ("Gadget", 49.5),
    ("Sprocket", 12.75),
    ("Gizmo", 99.0),
    ("Doohickey", 7.25),
    ("Thingamajig", 150.0),
    ("Whatsit", 33.3),
    ("Contraption", 220.0),
]
REGIONS = ["North", "South", "East", "West"]
STREETS = ["Oak St", "Maple Ave", "Pine Rd", "Cedar Ln", "Elm St", "Birch Way", "Lake Dr", "Hill Rd"]
CITIES = [
    ("Springfield", "62701"),
    ("Riverton", "82501"),
    ("Fairview", "37062"),
    ("Greenville", "29601"),
    ("Madison", "53703"),
    ("Salem", "97301"),
    ("Bristol", "06010"),
    ("Clinton", "20735"),
]
ORDER_STATUSES = ["pending", "processing", "shipped", "delivered", "delivered", "cancelled"]


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def company_files(rng: random.Random) -> dict[str, str]:
    departments = [
        {"id": i + 1, "name": n, "location": loc, "budget": b} for i, (n, loc, b) in enumerate(DEPARTMENTS)
    ]
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], 240)
    employees = []
    for i, name in enumerate(names):
        dept = departments[min(int(rng.expovariate(0.35)), len(departments) - 1)]
        title = rng.choice(TITLES[dept["name"]])
        senior = any(word in title for word in ("Senior", "Staff", "Lead", "Manager", "Controller"))
        salary = int(round(rng.gauss(58_000 + 4_000 * (dept["id"] % 5) + 16_000 * senior, 9_000), -2))
        employees.append(
            {
                "id": i + 1,
                "name": name,
                "department_id": dept["id"],
                "title": title,
                "salary": max(salary, 30_000),
                "hire_date": f"{rng.randint(2012, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            }
        )
    sellers = [e for e in employees if e["department_id"] == 2] + rng.sample(employees, 10)
    sales = []
    for i in range(480):
        product, price = rng.choice(PRODUCTS)
        qty = rng.randint(1, 20)
        sales.append(
            {
                "id": i + 1,
                "employee_id": rng.choice(sellers)["id"],
                "region": rng.choice(REGIONS),
                "product": product,
                "quantity": qty,
                "amount": round(price * qty, 2),
                "sale_date": f"{rng.randint(2021, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            }
        )
    return {"departments.csv": _csv(departments), "employees.csv": _csv(employees), "sales.csv": _csv(sales)}


def orders_file(rng: random.Random) -> dict[str, str]:
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], 40)
    users, orders = [], []
    for i, name in enumerate(names):
        city, zip_code = rng.choice(CITIES)
        first, last = name.lower().split()
        users.append(
            {
                "id": f"U{i + 1:03d}",
                "name": name,
                "email": f"{first}.{last}@example.com",
                "zip": zip_code,
                "address": f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {city} {zip_code}",
            }
        )
    for user in users:
        for _ in range(rng.randint(1, 5)):
            items = [
                {"product": p, "price": price, "quantity": rng.randint(1, 3)}
                for p, price in rng.sample(PRODUCTS, rng.randint(1, 3))
            ]
            orders.append(
                {
                    "id": f"W{1000 + len(orders)}",
                    "user_id": user["id"],
                    "status": rng.choice(ORDER_STATUSES),
                    "items": items,
                    "total": round(sum(it["price"] * it["quantity"] for it in items), 2),
                    "address": user["address"],
                }
            )
    return {"orders.json": json.dumps({"users": users, "orders": orders}, indent=1) + "\n"}


# (entry point, signature, description, reference solution, hidden test calls)
PYTHON_TASKS: list[tuple[str, str, str, str, list[str]]] = [
    (
        "add",
        "add(a: int, b: int) -> int",
        "returns the sum of a and b",
        "def add(a, b):\n    return a + b\n",
        ["add(2, 3)", "add(-4, 4)", "add(0, 0)", "add(123, 877)"],
    ),
    (
        "fizzbuzz",
        "fizzbuzz(n: int) -> list[str]",
        "returns the strings for 1..n where multiples of 3 are 'Fizz', of 5 'Buzz', of both 'FizzBuzz', "
        "and other numbers their decimal form",
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '')"
        " + ('Buzz' if i % 5 == 0 else '')\n        out.append(s or str(i))\n    return out\n",
        ["fizzbuzz(1)", "fizzbuzz(5)", "fizzbuzz(15)", "fizzbuzz(0)"],
    ),
    (
        "is_palindrome",
        "is_palindrome(s: str) -> bool",
        "returns True if s reads the same forwards and backwards, ignoring case and non-alphanumeric characters",
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
        [
            "is_palindrome('Racecar')",
            "is_palindrome('A man, a plan, a canal: Panama')",
            "is_palindrome('abc')",
            "is_palindrome('')",
            "is_palindrome('ab')",
        ],
    ),
    (
        "reverse_words",
        "reverse_words(s: str) -> str",
        "returns the words of s in reverse order, separated by single spaces",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        [
            "reverse_words('hello world')",
            "reverse_words('  a  b c ')",
            "reverse_words('one')",
            "reverse_words('')",
        ],
    ),
    (
        "count_vowels",
        "count_vowels(s: str) -> int",
        "returns how many vowels (a, e, i, o, u, any case) s has",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        ["count_vowels('hello')", "count_vowels('AEIOU')", "count_vowels('xyz')", "count_vowels('')"],
    ),
    (
        "factorial",
        "factorial(n: int) -> int",
        "returns n! for n >= 0",
        "def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out\n",
        ["factorial(0)", "factorial(1)", "factorial(5)", "factorial(10)"],
    ),
    (
        "fibonacci",
        "fibonacci(n: int) -> int",
        "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        ["fibonacci(0)", "fibonacci(1)", "fibonacci(10)", "fibonacci(30)"],
    ),
    (
        "flatten",
        "flatten(xs: list) -> list",
        "returns the elements of arbitrarily nested lists in order",
        "def flatten(xs):\n    out = []\n    for x in xs:\n        if isinstance(x, list):\n"
        "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
        ["flatten([1, [2, [3, 4]], 5])", "flatten([])", "flatten([[[]]])", "flatten([[1], [2], 3])"],
    ),
    (
        "running_sum",
        "running_sum(xs: list[int]) -> list[int]",
        "returns the cumulative sums of xs",
        "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
        "        out.append(total)\n    return out\n",
        ["running_sum([1, 2, 3])", "running_sum([])", "running_sum([5, -5, 5])"],
    ),
    (
        "second_largest",
        "second_largest(xs: list[int]) -> int | None",
        "returns the second largest distinct value of xs, or None when there is none",
        "def second_largest(xs):\n    values = sorted(set(xs))\n    return values[-2] if len(values) > 1 else None\n",
        [
            "second_largest([3, 1, 2])",
            "second_largest([5, 5, 4])",
            "second_largest([7])",
            "second_largest([])",
        ],
    ),
    (
        "run_length",
        "run_length(s: str) -> str",
        "returns the run-length encoding of s, each run written as the character followed by its count, "
        "e.g. 'aaab' -> 'a3b1'",
        "def run_length(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{s[i]}{j - i}')\n"
        "        i = j\n    return ''.join(out)\n",
        ["run_length('aaab')", "run_length('')", "run_length('abc')", "run_length('zzzzzzzzzzzz')"],
    ),
    (
        "is_prime",
        "is_prime(n: int) -> bool",
        "returns True if n is a prime number",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
        "        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
        ["is_prime(2)", "is_prime(1)", "is_prime(97)", "is_prime(91)", "is_prime(-7)"],
    ),
    (
        "word_count",
        "word_count(s: str) -> dict[str, int]",
        "returns how often each lower-cased whitespace-separated word occurs in s",
        "def word_count(s):\n    out = {}\n    for w in s.lower().split():\n        out[w] = out.get(w, 0) + 1\n"
        "    return out\n",
        ["word_count('a b a')", "word_count('')", "word_count('The the THE cat')"],
    ),
]


def python_tasks_file() -> dict[str, str]:
    """Coding tasks; expected outputs come from running each reference solution here."""
    lines = []
    for name, signature, description, solution, calls in PYTHON_TASKS:
        namespace: dict = {}
        exec(solution, namespace)  # our own reference solutions, to compute the expected outputs
        tests = [{"call": c, "expected": eval(c, namespace)} for c in calls]
        prompt = (
            f"Write a Python function `{signature}` that {description}. Reply with the complete "
            "function in a ```python code block."
        )
        lines.append(
            json.dumps(
                {
                    "id": f"py-{name}",
                    "prompt": prompt,
                    "answer": None,
                    "data": {"entry_point": name, "solution": solution, "tests": tests},
                }
            )
        )
    return {"python_tasks.jsonl": "\n".join(lines) + "\n"}


def generate() -> dict[str, str]:
    """File name -> content of every generated data file."""
    rng = random.Random(SEED)
    return {**company_files(rng), **orders_file(rng), **python_tasks_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        stale = [
            n
            for n, text in files.items()
            if not (DATA_DIR / n).exists() or (DATA_DIR / n).read_text(encoding="utf-8") != text
        ]
        print("stale: " + ", ".join(stale) if stale else "data files are up to date")
        return 1 if stale else 0
    DATA_DIR.mkdir(exist_ok=True)
    for name, text in files.items():
        (DATA_DIR / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
