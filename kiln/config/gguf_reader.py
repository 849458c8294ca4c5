"""gguf's reader of a GGUF file, its failures said in terms of the file: a damaged file (an
interrupted download) names itself, not the numpy error its parse happens to hit; a tensor of a
quantization type this gguf package does not know (a newer llama.cpp's) names the type id and
the tensor, not "truncated or damaged", which it is not."""
import functools
import importlib.metadata
from pathlib import Path

from kiln.errors import ConfigError


class UnknownQuantType(ValueError):
    """A tensor's type id is none of gguf's GGMLQuantizationType."""

    def __init__(self, tensor: str, type_id: int):
        super().__init__(tensor, type_id)
        self.tensor, self.type_id = tensor, type_id


def open_gguf(path: Path):
    """gguf's GGUFReader of `path`; ValueError naming the file and the fix where it fails."""
    size = path.stat().st_size
    try:
        return _reader_class()(str(path))
    except UnknownQuantType as e:
        raise ConfigError(
            f"GGUF file {path}: tensor {e.tensor} is stored in quantization type {e.type_id}, "
            f"which the installed gguf package ({importlib.metadata.version('gguf')}) does not "
            "know (a type newer llama.cpp versions write); upgrade it (pip install -U gguf) or "
            "use a file quantized to a type it knows, such as Q8_0, Q4_K_M or F16") from None
    except Exception as e:  # noqa: BLE001 - any parse error means a file gguf cannot read
        raise ConfigError(f"GGUF file {path} ({size} bytes) cannot be read ({type(e).__name__}: "
                          f"{e}): it is truncated or damaged; download or convert it again") from e


@functools.cache
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """gguf's reader, first checking each tensor's type id against the types gguf knows:
        its own `GGMLQuantizationType(id)` fails naming neither the tensor nor the cause."""

        def _build_tensors(self, start_offs, fields):
            known = {int(t) for t in gguf.GGMLQuantizationType}
            for field in fields:
                try:  # gguf's layout of a tensor's info, as its _build_tensors unpacks it
                    _name_len, _name, _n_dims, _dims, raw_type, _offset = field.parts
                    type_id = int(raw_type[0])
                except (ValueError, TypeError, IndexError):  # another layout: gguf judges
                    break
                if type_id not in known:
                    raise UnknownQuantType(field.name, type_id)
            super()._build_tensors(start_offs, fields)
    return Reader
