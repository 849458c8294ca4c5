"""The model names a server answers to: GET /v1/models and the `model` check of every request.

The first served name is the default when a request leaves `model` out.
"""
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.response_models import ModelCard, ModelList


class ServingModels:
    def __init__(self, served_model_names: list[str], root: str, max_model_len: int):
        """`root`: what /v1/models reports the names come from (the --model value as given,
        never a resolved cache path)."""
        if not served_model_names:
            raise ValueError("served_model_names is empty; pass --served-model-name or --model")
        self.names = list(served_model_names)
        self.root = root
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
