"""The server's LoRA adapters: vLLM's --lora-modules (name=path, or a JSON object with name,
path and base_model_name), each served under its name (a request's `model` picks it)."""
import argparse
import json

from kiln.lora.request import LoRARequest


def lora_module_flag(text: str) -> dict:
    """One --lora-modules value as vLLM takes it: `name=path` or
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r} ({e})") \
                from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(f"--lora-modules: a JSON value needs \"name\" and "
                                             f"\"path\" strings, got {text!r}")
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules: unknown key(s) {unknown} in "
                                             f"{text!r}; it takes name, path, base_model_name")
        return {"name": value["name"], "path": value["path"],
                "base_model_name": value.get("base_model_name")}
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path or a JSON object, "
                                         f"got {text!r}")
    return {"name": name.strip(), "path": path.strip(), "base_model_name": None}


def lora_requests(modules: list[dict] | None) -> list[LoRARequest]:
    """--lora-modules as LoRARequests, ids 1, 2, ... in the order given; a name given twice is
    refused (which would a request get?)."""
    out, seen = [], set()
    for i, module in enumerate(modules or [], start=1):
        if module["name"] in seen:
            raise ValueError(f"--lora-modules names {module['name']!r} twice")
        seen.add(module["name"])
        out.append(LoRARequest(module["name"], i, module["path"], module.get("base_model_name")))
    return out


def refuse_lora_beam_search(lora) -> None:
    if lora is not None:
        from kiln.entrypoints.openai.errors import OpenAIError

        raise OpenAIError(f"use_beam_search=true is not supported with a LoRA adapter "
                          f"({lora.lora_name!r}) yet", param="use_beam_search",
                          code="unsupported_parameter")


def checked_lora_requests(llm, modules: list[dict] | None) -> list[LoRARequest]:
    """--lora-modules as LoRARequests, each adapter read and checked now (a bad one stops the
    server at start, naming it, not its first request)."""
    requests = lora_requests(modules)
    if not requests:
        return requests
    checker = llm.engine.input_processor.lora_checker
    for lora in requests:
        checker.check(lora)
    return requests


def add_lora_routes(app, llm, models) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (served where
    VLLM_ALLOW_RUNTIME_LORA_UPDATING / KILN_ALLOW_RUNTIME_LORA_UPDATING is on)."""
    from fastapi import Response
    from pydantic import BaseModel

    from kiln.entrypoints.openai.errors import OpenAIError

    class LoadLoRAAdapterRequest(BaseModel):
        lora_name: str
        lora_path: str
        load_inplace: bool = False

    class UnloadLoRAAdapterRequest(BaseModel):
        lora_name: str
        lora_int_id: int | None = None

    checker = llm.engine.input_processor.lora_checker

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        lora = models.lora_to_add(req.lora_name, req.lora_path, req.load_inplace)
        try:  # the adapter is read and checked off the event loop
            lora = await llm.run_in_engine(checker.check, lora)
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_path") from None
        models.add_lora(lora, req.load_inplace)
        return Response(content=f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                        status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        models.remove_lora(req.lora_name)
        return Response(content=f"Success: LoRA adapter '{req.lora_name}' removed "
                                "successfully.", status_code=200)
