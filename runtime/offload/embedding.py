"""`EmbeddingRows`: token embeddings read row by row from the checkpoint file, for an embedding kept on disk.

A decode step needs only the rows of its tokens (a few KB each), so the [vocab, hidden] table (467 MB for a
151k-token vocabulary at 1536 wide in 16 bits) need not be resident. Rows are read with `os.pread` and cast
to the compute dtype (a block-quantized table, a GGUF's: each row's blocks dequantized by its format); repeated ids
in a batch are read once.
"""

from __future__ import annotations

import os

import torch

from ..formats import dequantize
from ..models.checkpoint import Checkpoint
from ..models.errors import CheckpointError


class EmbeddingRows:
    """Reads rows of tensor `name` ([vocab, hidden]) from its safetensors file."""

    def __init__(self, checkpoint: Checkpoint, name: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self._fd = -1
        quant = checkpoint.quantized(name)
        if quant is not None and len(quant.components) != 1:
            raise CheckpointError(f"{name} of {checkpoint.path} is stored as {quant.spec.label}, whose rows are not "
                                  "read one by one: keep the embedding resident")
        #: the format of a block-quantized table (rows of whole blocks), None for a plain one
        self.fmt = quant.spec if quant is not None else None
        self.location = quant.components[0].location if quant is not None else checkpoint.file_of(name)
        self.shape = checkpoint.shape(name)  # (vocab, hidden)
        self.file_dtype = checkpoint.torch_dtype(name)
        self.row_bytes = self.location.length // self.shape[0]
        self.dtype = dtype
        self.device = torch.device(device)
        self.bytes_read = 0
        try:
            self._fd = os.open(self.location.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.location.path} for embedding rows: {exc}") from exc

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> hidden [B, T, H] in the compute dtype."""
        unique, inverse = torch.unique(input_ids.cpu(), return_inverse=True)  # [U], [B, T]
        buf = bytearray(self.row_bytes * len(unique))
        for n, token in enumerate(unique.tolist()):
            offset = self.location.offset + token * self.row_bytes
            data = os.pread(self._fd, self.row_bytes, offset)
            if len(data) != self.row_bytes:
                raise CheckpointError(
                    f"truncated checkpoint {self.location.path}: embedding row {token} at byte {offset} is missing"
                )
            buf[n * self.row_bytes : (n + 1) * self.row_bytes] = data
        self.bytes_read += len(buf)
        if self.fmt is not None:
            blocks = torch.frombuffer(buf, dtype=torch.uint8).view(len(unique), self.row_bytes)  # [U, row bytes]
            rows = dequantize({"qweight": blocks}, self.fmt, (len(unique), self.shape[1]), self.dtype, self.device)
        else:
            rows = torch.frombuffer(buf, dtype=self.file_dtype).view(len(unique), self.shape[1])  # [U, H]
            rows = rows.to(dtype=self.dtype, device=self.device)
        return rows[inverse.to(self.device)]  # [B, T, H]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
