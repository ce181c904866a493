"""T5's activation arena: every tensor of one micro-batch in one float32 buffer, named views;
in mixed precision the blocks' saved tensors as 16-bit words beside it (``saved_words``)."""

from __future__ import annotations

import math

import numpy as np

from simdist.kernels.relpos import bucket_args, relpos_buckets

from .saved_words import SavedWords, SavedWordsViews, aligned_layout

F32 = np.float32
EPS = F32(1e-6)  # T5's layer_norm_epsilon
ARENA_ALIGN = 16  # elements (64 bytes): every tensor on its own cache line


def activation_shapes(cfg, B: int, packed: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every arena tensor for micro-batch B, in arena order. int32 and
    uint64 tensors are carved from the float32 arena (aligned, so the views are legal).
    ``packed``: the ``packed_names`` tensors are float32 working copies of
    ``working_copies`` blocks, not of every block (all blocks are in the uint16 store of
    ``saved_shapes``)."""
    shapes = _activation_shapes(cfg, B)
    if packed:
        for name in packed_names(cfg):
            shape, dtype = shapes[name]
            shapes[name] = ((working_copies(cfg, name), *shape[1:]), dtype)
    return shapes


def own_packed(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(encoder, decoder) block tensors that the block's backward reads, held as 16-bit
    words in mixed precision once the block's forward ends."""
    enc = ("e_n1", "e_q", "e_k", "e_v", "e_ctx", "e_xm", "e_n2", "e_h", "e_a")
    dec = ("s_n", "s_q", "s_k", "s_v", "s_ctx", "s_xm", "c_n", "c_q", "c_k", "c_v", "c_ctx",
           "c_xm", "f_n", "f_h", "f_a")  # fmt: skip
    if cfg.gated:
        enc, dec = (*enc, "e_h1", "e_g"), (*dec, "f_h1", "f_g")
    return enc, dec


def packed_names(cfg) -> tuple[str, ...]:
    """Every tensor of the 16-bit store: the blocks' own and the residual streams entering
    them (``ex``, ``dy``: block i packs its input; the last output, read by the final norm,
    stays in its working copy)."""
    enc, dec = own_packed(cfg)
    return (*enc, *dec, "ex", "dy")


def working_copies(cfg, name: str) -> int:
    """Blocks of float32 working copies of a packed tensor: two of the residual streams
    (block i reads its input while it writes its output), one of the rest."""
    if name == "ex":
        return min(cfg.num_layers + 1, 2)
    if name == "dy":
        return min(cfg.num_decoder_layers + 1, 2)
    return 1


def saved_shapes(cfg, B: int) -> dict[str, tuple[int, ...]]:
    """The uint16 store of mixed precision: every block's packed tensors."""
    shapes = _activation_shapes(cfg, B)
    return {name: shapes[name][0] for name in packed_names(cfg)}


def _activation_shapes(cfg, B: int) -> dict[str, tuple[tuple[int, ...], str]]:
    L, Ld, NH = cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads
    D, C, F, V = cfg.d_model, cfg.inner, cfg.d_ff, cfg.vocab_size
    Te, Td = cfg.max_seq_length, cfg.target_length
    Ne, Nd = B * Te, B * Td
    Nm, Tm = max(Ne, Nd), max(Te, Td)
    Fg = F if cfg.gated else 0  # the gated FFN's second projection and its GELU
    f, i = "f4", "i4"
    return {
        "enc_ids": ((Ne,), i),
        "dec_ids": ((Nd,), i),
        "labels": ((Nd,), i),
        "keys": ((B,), "u8"),
        "enc_keep": ((B, Te), f),
        "dec_keep": ((B, Td), f),
        "e_buckets": ((Te, Te), i),
        "d_buckets": ((Td, Td), i),
        "e_bias": ((NH, Te, Te), f),
        "d_bias": ((NH, Td, Td), f),
        # encoder: ex[i] is block i's input, ex[L] the last block's output
        "ex": ((L + 1, Ne, D), f),
        "e_n1": ((L, Ne, D), f),
        "e_r1": ((L, Ne), f),
        "e_q": ((L, Ne, C), f),
        "e_k": ((L, Ne, C), f),
        "e_v": ((L, Ne, C), f),
        "e_att": ((L, B, NH, Te, Te), f),
        "e_ctx": ((L, Ne, C), f),
        "e_xm": ((L, Ne, D), f),  # x + attention branch: the FFN norm's input
        "e_n2": ((L, Ne, D), f),
        "e_r2": ((L, Ne), f),
        "e_h": ((L, Ne, F), f),  # wi (wi_0) output
        "e_h1": ((L, Ne, Fg), f),  # wi_1 output (gated)
        "e_g": ((L, Ne, Fg), f),  # gelu(wi_0 output) (gated)
        "e_a": ((L, Ne, F), f),  # the FFN activation after dropout: wo's input
        "e_rf": ((Ne,), f),
        "enc_out": ((Ne, D), f),
        # decoder
        "dy": ((Ld + 1, Nd, D), f),
        "s_n": ((Ld, Nd, D), f),
        "s_r": ((Ld, Nd), f),
        "s_q": ((Ld, Nd, C), f),
        "s_k": ((Ld, Nd, C), f),
        "s_v": ((Ld, Nd, C), f),
        "s_att": ((Ld, B, NH, Td, Td), f),
        "s_ctx": ((Ld, Nd, C), f),
        "s_xm": ((Ld, Nd, D), f),
        "c_n": ((Ld, Nd, D), f),
        "c_r": ((Ld, Nd), f),
        "c_q": ((Ld, Nd, C), f),
        "c_k": ((Ld, Ne, C), f),
        "c_v": ((Ld, Ne, C), f),
        "c_att": ((Ld, B, NH, Td, Te), f),
        "c_ctx": ((Ld, Nd, C), f),
        "c_xm": ((Ld, Nd, D), f),
        "f_n": ((Ld, Nd, D), f),
        "f_r": ((Ld, Nd), f),
        "f_h": ((Ld, Nd, F), f),
        "f_h1": ((Ld, Nd, Fg), f),
        "f_g": ((Ld, Nd, Fg), f),
        "f_a": ((Ld, Nd, F), f),
        "d_rf": ((Nd,), f),
        "dec_out": ((Nd, D), f),
        "dec_scaled": ((Nd, D), f),
        "logits": ((Nd, V), f),
        "probs": ((Nd, V), f),  # backward overwrites with dlogits
        "losses": ((Nd,), f),
        # gradients of activations, reused block after block
        "tD": ((Nm, D), f),
        "ge": ((Ne, D), f),
        "gd": ((Nd, D), f),
        "g_enc": ((Ne, D), f),
        "g_n": ((Nm, D), f),
        "g_q": ((Nm, C), f),
        "g_k": ((Nm, C), f),
        "g_v": ((Nm, C), f),
        "g_ctx": ((Nm, C), f),
        "g_h": ((Nm, F), f),
        "g_h1": ((Nm, Fg), f),
        "g_a": ((Nm, F), f),
        "e_dbias": ((NH, Te, Te), f),
        "d_dbias": ((NH, Td, Td), f),
        "scratch": ((7, Tm, cfg.d_kv), f),
        "att_ds": ((Tm * Tm,), f),
    }


def arena_layout(cfg, B: int, packed: bool = False) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total float32 elements) of the arena (``packed``: with
    working copies of the packed tensors)."""
    sizes = {
        name: math.prod(shape) * (2 if dtype == "u8" else 1)
        for name, (shape, dtype) in activation_shapes(cfg, B, packed).items()
    }
    return aligned_layout(sizes, ARENA_ALIGN)


def store_layout(cfg, B: int) -> tuple[dict[str, int], int]:
    """(offset of each tensor, total uint16 words) of mixed precision's 16-bit store."""
    return aligned_layout({n: math.prod(s) for n, s in saved_shapes(cfg, B).items()}, ARENA_ALIGN)


class Views(SavedWordsViews):
    """Named views of the arena for one micro-batch size B (per-block tensors as lists)."""

    def __init__(
        self,
        arena: np.ndarray,
        cfg,
        B: int,
        offsets: dict,
        store: tuple[np.ndarray, dict[str, int], int] | None = None,
    ):
        """``store``: mixed precision's (uint16 store, its offsets, half format); the
        arena then holds ``working_copies`` blocks of the packed tensors."""
        self.B = B
        Te, Td = cfg.max_seq_length, cfg.target_length
        self.Ne, self.Nd = B * Te, B * Td
        self.enc_own, self.dec_own = own_packed(cfg)
        self._words: SavedWords | None = None
        if store is not None:
            self._words = SavedWords(store[0], store[1], saved_shapes(cfg, B), store[2])
        packed = packed_names(cfg) if store is not None else ()
        for name, (shape, dtype) in activation_shapes(cfg, B, store is not None).items():
            lo = offsets[name]
            n = math.prod(shape) * (2 if dtype == "u8" else 1)
            flat = arena[lo : lo + n]
            if dtype == "i4":
                flat = flat.view(np.int32)
            elif dtype == "u8":
                flat = flat.view(np.uint64)
            arr = flat.reshape(shape)
            if name in packed:  # block i: working copy i % w
                arr = self._words.working(name, arr)
            elif name in _PER_BLOCK:
                arr = list(arr)
            setattr(self, name, arr)
        if not cfg.gated:  # unused: point them at real tensors of the right type
            self.e_h1, self.e_g, self.f_h1, self.f_g = self.e_h, self.e_h, self.f_h, self.f_h
            self.g_h1 = self.g_h
        self.ds_ee = self.att_ds[: Te * Te].reshape(Te, Te)
        self.ds_dd = self.att_ds[: Td * Td].reshape(Td, Td)
        self.ds_de = self.att_ds[: Td * Te].reshape(Td, Te)
        self.dec_keep.fill(1.0)  # the decoder's inputs are never padding
        nb, md = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        relpos_buckets(self.e_buckets, True, nb, *bucket_args(nb, md, True))
        relpos_buckets(self.d_buckets, False, nb, *bucket_args(nb, md, False))
        self._te, self._td = Te, Td

    def enc3(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.B, self._te, -1)

    def dec3(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.B, self._td, -1)


_PER_BLOCK = {
    "ex", "e_n1", "e_r1", "e_q", "e_k", "e_v", "e_att", "e_ctx", "e_xm", "e_n2", "e_r2",
    "e_h", "e_h1", "e_g", "e_a", "dy", "s_n", "s_r", "s_q", "s_k", "s_v", "s_att", "s_ctx",
    "s_xm", "c_n", "c_r", "c_q", "c_k", "c_v", "c_att", "c_ctx", "c_xm", "f_n", "f_r", "f_h",
    "f_h1", "f_g", "f_a",
}  # fmt: skip
