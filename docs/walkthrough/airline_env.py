"""Airline-v0: change or cancel a booking under a fare rule, on a database built from the task's seed."""

import random

import gymnasium

from miles.envs import OraclePolicy, ToolEnv, register, reward, run_episode
from miles.envs.tasks import Task, TaskSource
from miles.tools import tool
from miles.types import Message, ToolCall


def build_db(seed: int) -> dict:
    """One route's flights on days 1-5 and one booking on them: the same database for the same seed."""
    rng = random.Random(seed)
    origin, destination = rng.choice([("SFO", "JFK"), ("SEA", "BOS"), ("LAX", "ORD")])
    number = rng.randrange(10, 100)
    flights = {f"AF{number}{day}": day for day in range(1, 6)}
    booking_id, day, fare = f"B{rng.randrange(100, 1000)}", rng.randint(1, 5), rng.choice(["basic", "flex"])
    booking = {"id": booking_id, "flight": f"AF{number}{day}", "fare": fare, "status": "active"}
    return {"origin": origin, "destination": destination, "flights": flights, "booking": booking}


def make_task(rng) -> Task:  # "B417 (SEA to BOS): please move it to day 4." or "... please cancel it."
    seed = int(rng.integers(1 << 30))
    db = build_db(seed)
    booked_day = db["flights"][db["booking"]["flight"]]
    day = int(rng.choice([d for d in range(1, 6) if d != booked_day]))
    action = "cancel" if rng.random() < 0.3 else "change"
    ask = "please cancel it." if action == "cancel" else f"please move it to day {day}."
    prompt = f"Booking {db['booking']['id']} ({db['origin']} to {db['destination']}): {ask}"
    return Task(id="", prompt=prompt, data={"seed": seed, "action": action, "day": day})


def goal(task: Task) -> dict:  # the booking as it must end: basic fares never change flights
    db = build_db(task.data["seed"])
    booking = dict(db["booking"])
    if task.data["action"] == "cancel":
        booking["status"] = "cancelled"
    elif booking["fare"] != "basic":
        booking["flight"] = next(f for f, d in db["flights"].items() if d == task.data["day"])
    return booking


class AirlineOracle(OraclePolicy):  # look the booking up, then do what the fare allows, then answer
    def act(self, messages: list[Message]) -> Message:
        task, db = self.task, build_db(self.task.data["seed"])
        booking_id = db["booking"]["id"]
        plan = [("get_booking", {"booking_id": booking_id})]
        if task.data["action"] == "cancel":
            plan.append(("cancel_booking", {"booking_id": booking_id}))
        elif db["booking"]["fare"] != "basic":
            flight = goal(task)["flight"]
            route = {"origin": db["origin"], "destination": db["destination"], "day": task.data["day"]}
            plan += [
                ("search_flights", route),
                ("change_flight", {"booking_id": booking_id, "flight": flight}),
            ]
        done = sum(len(m.tool_calls) for m in messages if m.role == "assistant")
        if done < len(plan):
            name, args = plan[done]
            return Message("assistant", tool_calls=[ToolCall(name, args, id=f"call_{done}")])
        return Message("assistant", "Done." if len(plan) > 1 else "A basic fare cannot be changed.")


class AirlineEnv(ToolEnv):
    max_turns = 5

    def default_tasks(self) -> TaskSource:
        return TaskSource.from_generator(make_task, name="airline")

    async def on_reset(self, task: Task) -> None:  # a fresh database every episode, from the task's seed
        self.state["db"], self.state["looked_up"] = build_db(task.data["seed"]), False

    def _booking(self, booking_id: str) -> dict:
        booking = self.state["db"]["booking"]
        if booking_id != booking["id"]:
            raise KeyError(f"no booking {booking_id}")
        return booking

    @tool
    def search_flights(self, origin: str, destination: str, day: int) -> list[str]:
        """The flights from `origin` to `destination` on `day` (1-5)."""
        db = self.state["db"]
        if (origin, destination) != (db["origin"], db["destination"]):
            return []
        return [flight for flight, d in db["flights"].items() if d == day]

    @tool
    def get_booking(self, booking_id: str) -> dict:
        """The booking's flight, fare class ("basic" or "flex") and status."""
        booking = dict(self._booking(booking_id))
        self.state["looked_up"] = True
        return booking

    @tool
    def change_flight(self, booking_id: str, flight: str) -> str:
        """Move the booking to another flight of its route."""
        booking = self._booking(booking_id)
        if booking["fare"] == "basic":
            raise PermissionError("policy: a basic fare cannot be changed")
        if flight not in self.state["db"]["flights"]:
            raise KeyError(f"no flight {flight} on this route")
        booking["flight"] = flight
        return f"{booking_id} is now on {flight}"

    @tool
    def cancel_booking(self, booking_id: str) -> str:
        """Cancel the booking."""
        self._booking(booking_id)["status"] = "cancelled"
        return f"{booking_id} is cancelled"

    def oracle(self) -> AirlineOracle:
        return AirlineOracle().bind(self)

    @reward(weight=1.0)  # the booking ends as it must, and the agent looked at it before deciding
    def booking_right(self, task: Task, state: dict) -> float:
        return float(state["looked_up"] and state["db"]["booking"] == goal(task))


register("Airline-v0", AirlineEnv)

if __name__ == "__main__":  # python airline_env.py: the env through gymnasium
    env = gymnasium.make("miles/Airline-v0").unwrapped
    print(run_episode(env, seed=0).reward)  # its oracle solves the task: 1.0
    env.reset(seed=3)  # "Booking B296 (SFO to JFK): please move it to day 5.", on a basic fare
    call = ToolCall("change_flight", {"booking_id": "B296", "flight": "AF995"}, id="call_0")
    print(env.step(Message("assistant", tool_calls=[call]))[0][0].content)  # the fare rule's error
