"""Bank-v0: move money between accounts with two tools; the reward checks the final balances."""

from miles.envs import ToolEnv, register, reward
from miles.envs.tasks import Task, TaskSource
from miles.tools import tool


def make_task(rng) -> Task:  # "Send 37 dollars from alice to bob." and the balances that must result
    amount = int(rng.integers(1, 100))
    return Task(
        id="",
        prompt=f"Send {amount} dollars from alice to bob.",
        data={"expected": {"alice": 100 - amount, "bob": 20 + amount}},
    )


class BankEnv(ToolEnv):
    max_turns = 4

    def default_tasks(self) -> TaskSource:  # the loop's `split` (train / held_out) is applied to these
        return TaskSource.from_generator(make_task, name="bank")

    async def on_reset(self, task: Task) -> None:  # per-episode state: fresh accounts every episode
        self.state["balances"] = {"alice": 100, "bob": 20}

    @tool
    def balance(self, account: str) -> int:
        """The balance of `account` ("alice" or "bob") in dollars."""
        return self.state["balances"][account]

    @tool
    def transfer(self, source: str, target: str, amount: int) -> str:
        """Move `amount` dollars from account `source` to account `target`."""
        balances = self.state["balances"]
        if not 0 < amount <= balances[source]:
            raise ValueError(f"cannot move {amount} dollars out of {source}")
        balances[source] -= amount
        balances[target] += amount
        return "done"

    @reward(weight=1.0)  # a hook asks for what it needs by name: task, state, final, messages, turn, ...
    def balances_right(self, task: Task, state: dict) -> float:
        return float(state["balances"] == task.data["expected"])


register("Bank-v0", BankEnv)
