"""`dsgrpo_chat`: verifiers v1's plain chat loop run inside the env host (issue 66), for tasksets without tools.
verifiers' own chat harness (`null`) starts a program per episode (a PEP 723 script through uv: a Python start and
the openai/mcp/httpx imports, about 0.8 s of CPU), which bounds a 2-core machine near one episode a second; this
harness sends the same requests (the task's system prompt and prompt, then the model's reply, until a reply without
tool calls) from the host's own event loop to the same interception endpoint, so verifiers still records the trace
and its TrainClient still renders and calls the trainer's /inference/v1/generate. A taskset with tool servers
needs the `null` harness (env_host_rollout(..., env={"DSGRPO_VERIFIERS_HARNESS": "null"}))."""

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire


class DsgrpoChatConfig(vf.HarnessConfig):
    max_turns: int = 1


class DsgrpoChat(vf.Harness[DsgrpoChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        if mcp_urls:
            raise ValueError("the dsgrpo_chat harness runs no tools: use the null harness for a taskset with tools")
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]

        # an async client, not a thread a call: the interception's TrainClient renders on the loop's thread pool,
        # which calls blocked in threads would fill (16 episodes at once hung a 2-core host that way)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False) as client:
            for _ in range(self.config.max_turns):
                response = await client.post(
                    endpoint.rstrip("/") + "/chat/completions",
                    json={"model": ctx.model, "messages": messages},
                    headers={"Authorization": f"Bearer {secret}"},
                )
                response.raise_for_status()
                message = response.json()["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                if not message.get("tool_calls"):
                    break
        return vf.ProgramResult(exit_code=0, stdout=message.get("content") or "", stderr="")


__all__ = ["DsgrpoChat"]
