"""Configuration of Virtual Width Networks (VWN, arXiv 2511.11238) over the dense decoder.

The backbone fields are ``LLMConfig``'s (width ``hidden_size`` = D, heads, FFN, RoPE...);
the VWN fields add the over-width state: ``vwn_m`` blocks of width D/m make up the backbone
vector and the wide state has ``vwn_n`` slots of the same width, so the virtual-width factor
is r = n/m and the state is D' = r * D wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from models.llm.config import LLMConfig


@dataclass
class VWNConfig(LLMConfig):
    """Backbone (``LLMConfig`` fields) plus the virtual width. Defaults: the paper's 1.5x, (m, n) = (2, 3)."""

    vwn_m: int = 2
    """Blocks the backbone vector is split into (the paper's fraction rate m)."""
    vwn_n: int = 3
    """Slots of the over-width state, each D/m wide; n >= m."""
    factorized_embedding: bool = False
    """``E_wide = W_expand E_base``: a D-wide table plus a learned D -> D' up-projection,
    instead of a D'-wide table (the paper's option for large r)."""
    reduce_group_norm: bool | None = None
    """GroupNorm (group size D) on the final wide state before the D' -> D reduce. None = the
    paper's choice: on for integer r > 1; off at fractional r (the paper omits it at 1.5x, where
    D' is not a multiple of D) and at r = 1 (one group; the final RMSNorm follows anyway)."""
    hyper_connections: bool = True
    """False: plain residual blocks, no wide state and no reduce (needs n == m). The
    non-VWN baseline of the paper's sweep, which may still carry the MTP head."""
    mtp: bool = False
    """Add the next-2-token (MTP) head: one extra hyper-connected block fed by a per-slot
    mix of the final wide state and the next token's wide embedding."""
    mtp_loss_weight: float = 0.3
    """Weight of the next-2-token cross entropy in the training loss (when ``mtp``)."""
    tie_embeddings: bool = False
    """Tying needs a D-wide table: only with ``factorized_embedding`` or n == m."""

    @property
    def block_dim(self) -> int:
        """Width D/m of one slot."""
        return self.hidden_size // self.vwn_m

    @property
    def wide_dim(self) -> int:
        """D' = n * D/m, the width of the over-width state."""
        return self.vwn_n * self.block_dim

    @property
    def virtual_width_factor(self) -> Fraction:
        """r = n/m."""
        return Fraction(self.vwn_n, self.vwn_m)

    @property
    def use_group_norm(self) -> bool:
        """Whether the output GroupNorm is on (resolving the ``None`` default)."""
        if self.reduce_group_norm is not None:
            return self.reduce_group_norm
        r = self.virtual_width_factor
        return self.hyper_connections and r.denominator == 1 and r > 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fields of any (m, n, D) combination that cannot be built."""
        super().validate()
        for name in ("vwn_m", "vwn_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.vwn_m:
            raise ValueError(f"hidden_size D={self.hidden_size} must be divisible by vwn_m={self.vwn_m}: "
                             f"the backbone vector is split into m blocks of D/m")
        if self.vwn_n < self.vwn_m:
            raise ValueError(f"vwn_n={self.vwn_n} must be >= vwn_m={self.vwn_m}: the wide state (n slots) "
                             "cannot be narrower than the backbone (m blocks)")
        if not self.hyper_connections and self.vwn_n != self.vwn_m:
            raise ValueError(f"hyper_connections=false is the plain residual baseline and needs "
                             f"vwn_n == vwn_m, got (m, n) = ({self.vwn_m}, {self.vwn_n})")
        if self.reduce_group_norm and (self.wide_dim % self.hidden_size or not self.hyper_connections):
            raise ValueError(f"reduce_group_norm=true needs D'={self.wide_dim} to be a multiple of the group "
                             f"size D={self.hidden_size} (integer r = n/m), with hyper_connections on")
        if self.tie_embeddings and not self.factorized_embedding and self.vwn_n != self.vwn_m:
            raise ValueError(f"tie_embeddings=true needs a D-wide embedding table, but the table is "
                             f"D'={self.wide_dim} wide: set factorized_embedding=true or "
                             "tie_embeddings=false")
        if self.factorized_embedding and not self.hyper_connections:
            raise ValueError("factorized_embedding needs hyper_connections "
                             "(there is no wide state to expand to)")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
