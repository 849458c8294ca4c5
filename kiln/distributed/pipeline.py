"""Pipeline-parallel model pieces: which layers a stage owns, and the placeholder for the rest.

A stage builds only its own layers (and the embedding on the first, the norm and head on the
last); the others stay as `PPMissingLayer`, so parameter names keep their checkpoint indices.
"""
from torch import nn

from kiln.distributed.parallel_state import get_pp_group
from kiln.errors import ConfigError


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers of stage `pp_rank`: equal shares, the first stages taking
    one more when they do not divide evenly."""
    if num_layers < pp_size:
        raise ConfigError(f"pipeline_parallel_size ({pp_size}) exceeds num_hidden_layers "
                          f"({num_layers}): every stage needs at least one layer")
    share, extra = divmod(num_layers, pp_size)
    start = pp_rank * share + min(pp_rank, extra)
    return start, start + share + (1 if pp_rank < extra else 0)


def this_stage_layer_range(num_layers: int) -> tuple[int, int]:
    pp = get_pp_group()
    return stage_layer_range(num_layers, pp.rank_in_group, pp.world_size)


class PPMissingLayer(nn.Module):
    """Stands where a module of another stage would be: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline stage called a layer that another stage owns")
