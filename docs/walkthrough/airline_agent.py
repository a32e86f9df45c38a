"""An agent for Airline-v0 on the `openai` client: the model picks the calls, the env's own tools run them."""

import json
import os
from urllib.parse import quote

import httpx
from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: the session's endpoint and its token
task = json.loads(os.environ["MILES_TASK"])  # the env's first messages and tool schemas
# POST .../sessions/ID/tools/NAME runs the env's tool NAME in the session's episode, on its database
tools = f"{os.environ['OPENAI_BASE_URL'].removesuffix('/v1')}/sessions/{os.environ['MILES_SESSION_ID']}/tools"
auth = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
messages = task["messages"]
for _ in range(5):
    reply = client.chat.completions.create(model="m", messages=messages, tools=task["tools"], max_tokens=48)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        name, arguments = quote(call.function.name, safe=""), call.function.arguments
        answer = httpx.post(f"{tools}/{name}", content=arguments, headers=auth)
        # the env's tool message; for a malformed call (no name, no JSON object), the route's 4xx
        content = answer.json()["content"] if answer.is_success else f"Error: {answer.text}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
