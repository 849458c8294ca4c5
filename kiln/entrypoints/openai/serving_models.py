"""The model names a server answers to: GET /v1/models and the `model` check of every request.

The first served name is the default when a request leaves `model` out.
"""
from kiln.engine.text_encoding import not_utf8
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.response_models import ModelCard, ModelList


class ServingModels:
    def __init__(self, served_model_names: list[str], root: str, max_model_len: int,
                 lora_requests=()):
        """`root`: what /v1/models reports the names come from (the --model value as given,
        never a resolved cache path). `lora_requests`: the --lora-modules adapters, each
        served by its lora_name (kiln/lora/)."""
        if not served_model_names:
            raise ValueError("served_model_names is empty; pass --served-model-name or --model")
        check_served_names(served_model_names)
        self.names = list(served_model_names)
        self.loras = {lora.lora_name: lora for lora in lora_requests}
        clash = sorted(set(self.loras) & set(self.names))
        if clash:
            raise ValueError(f"--lora-modules name(s) {clash} are also served model names "
                             "(--served-model-name); give each adapter its own name")
        self.root = displayable(root)
        self.max_model_len = max_model_len

    @property
    def default_name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request; an unknown name is a 404 `model_not_found` (as
        OpenAI and vLLM answer) naming `model`."""
        if requested is None:
            return self.default_name
        if requested not in self.names and requested not in self.loras:
            raise OpenAIError(f"The model `{requested}` does not exist; this server serves "
                              f"{self.names + list(self.loras)}", status=404, param="model",
                              code="model_not_found")
        return requested

    def lora_to_add(self, name: str, path: str, replace: bool = False):
        """The adapter a runtime load (vLLM's /v1/load_lora_adapter) adds, not yet read: a new
        lora_int_id, so a replaced adapter's weights are never taken for its predecessor's."""
        from kiln.lora.request import LoRARequest

        for field, value in (("lora_name", name), ("lora_path", path)):
            if not value:
                raise OpenAIError(f"{field} is empty: give the adapter's name and the path of "
                                  "its PEFT directory", param=field, code="invalid_value")
        self._refuse_taken(name, replace)
        self._next_lora_id = max([getattr(self, "_next_lora_id", 0)]
                                 + [lora.lora_int_id for lora in self.loras.values()]) + 1
        return LoRARequest(name, self._next_lora_id, path)

    def add_lora(self, lora, replace: bool = False) -> None:
        """Serve `lora` (lora_to_add's, read and checked since). On the event loop, as every
        read of `loras`: added from the thread that checked it, /v1/models iterating them
        failed (dictionary changed size during iteration)."""
        self._refuse_taken(lora.lora_name, replace)  # a load of the same name, meanwhile
        self.loras[lora.lora_name] = lora

    def _refuse_taken(self, name: str, replace: bool) -> None:
        if name in self.loras and not replace:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded. If you want "
                              "to load the adapter in place, set 'load_inplace' to True.",
                              param="lora_name")
        if name in self.names:
            raise OpenAIError(f"'{name}' is a served model name, not an adapter",
                              param="lora_name")

    def remove_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", status=404,
                              param="lora_name", code="model_not_found")

    def lora_request(self, name: str):
        """The adapter a resolved model name serves (kiln.lora.request.LoRARequest), or None
        for the base model."""
        return self.loras.get(name)

    def list_models(self) -> ModelList:
        base = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len)
                for name in self.names]
        # vLLM's adapter cards: root the adapter's path, parent the base model's name
        adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path,
                              parent=lora.base_model_name or self.default_name,
                              max_model_len=self.max_model_len)
                    for lora in self.loras.values()]
        return ModelList(data=base + adapters)


def check_served_names(names: list[str]) -> None:
    """Bytes that are not UTF-8 on the command line become lone surrogates, and every response
    naming the model failed to render: a 500, after the generation."""
    for name in names:
        if (problem := not_utf8(name)) is not None:
            raise ValueError(f"--served-model-name {name!r} {problem}, which no response can "
                             "carry")


def displayable(name: str) -> str:
    """A name from the --model path as text a response can carry: a folder whose name is not
    UTF-8 reaches Python with lone surrogates, shown as U+FFFD (the model still loads)."""
    if not_utf8(name) is None:
        return name
    return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in name)
