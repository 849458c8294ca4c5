"""The model names a server answers to: GET /v1/models and the `model` check of every request.

The first served name is the default when a request leaves `model` out.
"""
from kiln.engine.text_encoding import not_utf8
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.response_models import ModelCard, ModelList


class ServingModels:
    def __init__(self, served_model_names: list[str], root: str, max_model_len: int):
        """`root`: what /v1/models reports the names come from (the --model value as given,
        never a resolved cache path)."""
        if not served_model_names:
            raise ValueError("served_model_names is empty; pass --served-model-name or --model")
        check_served_names(served_model_names)
        self.names = list(served_model_names)
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
        if requested not in self.names:
            raise OpenAIError(f"The model `{requested}` does not exist; this server serves "
                              f"{self.names}", status=404, param="model",
                              code="model_not_found")
        return requested

    def list_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.root,
                                         max_model_len=self.max_model_len)
                               for name in self.names])


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
