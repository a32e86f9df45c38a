"""An off-the-shelf agent framework, the OpenAI Agents SDK (`openai-agents` from PyPI), runs offline against
the endpoint's `base_url` and completes a two-turn tool task; the recorded trajectory is token-exact."""

from __future__ import annotations

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from miles.sessions.instant import InstantEngine
from miles.sessions.openai.endpoint import OpenAIEndpoint
from miles.sessions.openai.routes import EndpointServer, create_openai_app
from miles.sessions.replay import check_tito
from miles.tito.conversation import Conversation
from miles.types import Message
from tests.support.openai import call, tito


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_agents_sdk_completes_a_two_turn_tool_task(streamed):
    set_tracing_disabled(True)
    t = tito("tiny")
    replies = [
        Message("assistant", "", [call("calculate", '{"expression": "3 + 4"}')]),
        Message("assistant", "The answer is 7."),
    ]
    # the tiny template renders an assistant turn the same after any history
    outputs = [t.expected_generation([Message("user", "q")], m) for m in replies]
    endpoint = OpenAIEndpoint(InstantEngine(outputs), tokenizer=t)
    server = EndpointServer(create_openai_app(endpoint))
    await server.start()
    seen: list[str] = []

    @function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: arithmetic such as 3 + 4 * 2.
        """
        seen.append(expression)
        return "7"

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="sdk-1", max_retries=0)
    agent = Agent(
        name="calculator",
        instructions="Use the calculate tool, then answer.",
        tools=[calculate],
        model=OpenAIChatCompletionsModel(model="miles-tiny", openai_client=client),
        model_settings=ModelSettings(temperature=1.0, max_tokens=64),
    )
    try:
        if streamed:
            run = Runner.run_streamed(agent, "What is 3 + 4?")
            async for _ in run.stream_events():
                pass
            final = run.final_output
        else:
            final = (await Runner.run(agent, "What is 3 + 4?")).final_output
        [record] = await endpoint.close("sdk-1")
    finally:
        await server.stop()
        await endpoint.aclose()
    assert final == "The answer is 7." and seen == ["3 + 4"]
    assert [m["role"] for m in record.initial_messages] == ["system", "user"]
    assert record.tools[0]["function"]["name"] == "calculate"
    assert [m["role"] for m in record.turns[0].observation] == ["tool"]
    assert record.turns[0].observation[0]["content"] == "7"
    # the trajectory equals a direct TITO session fed the same messages and outputs
    conv = Conversation(t, [Message.from_dict(m) for m in record.initial_messages], tools=record.tools)
    conv.append_generation(outputs[0], [-0.5] * len(outputs[0]), weight_version=0, finish_reason="stop")
    conv.append_observation(replies[0], [Message.from_dict(m) for m in record.turns[0].observation])
    conv.append_generation(outputs[1], [-0.5] * len(outputs[1]), weight_version=0, finish_reason="stop")
    conv.finish(replies[1])
    assert record.trajectory.token_ids == conv.trajectory.token_ids
    assert record.trajectory.loss_mask == conv.trajectory.loss_mask
    assert check_tito(record, t).ok
    info = record.final_info["tito"]
    assert info["special_tokens"] == 0 and info["non_assistant_text"] == 0 and info["exact"], info["summary"]
