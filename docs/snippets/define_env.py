from miles.envs import ToolEnv, make, register, reward, run_episode
from miles.tools import tool
from miles.types import Message, ToolCall


class WeatherEnv(ToolEnv):
    @tool
    def get_temperature(self, city: str) -> int:
        """Current temperature in degrees Celsius in `city`."""
        return {"Paris": 18, "Oslo": 4}[city]

    @reward(weight=1.0)
    def correct(self, final: str, answer: int) -> float:
        return float(final == f"It is {answer} degrees.")


def policy(messages: list[Message]) -> Message:  # scripted: call the tool, then answer
    if messages[-1].role == "user":
        return Message("assistant", tool_calls=[ToolCall("get_temperature", {"city": "Oslo"})])
    return Message("assistant", f"It is {messages[-1].content} degrees.")


register("Weather-v0", WeatherEnv, tasks=[{"prompt": "How warm is it in Oslo?", "answer": 4}])
env = make("Weather-v0")
print(env.tool_schemas()[0]["function"]["name"])  # get_temperature
result = run_episode(env, policy, seed=0)
print(result.reward, result.info["reward_components"])  # 1.0 {'correct': 1.0}
