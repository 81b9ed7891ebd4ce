"""Every fleet message, defined once: small fields (pydantic) plus binary sections.

A message class declares ``schema``, ``version`` and its sections (name -> wire dtype).
:func:`to_frame` and :func:`from_frame` are the only codec; both ends use them, so a field
can never be written one way and read another. Masks travel as bitsets (``np.packbits``,
section dtype ``u8``, with the vector length in a field).

Version rule: a receiver accepts exactly the version it was built with and otherwise
rejects the message saying which side is older, so old agents fail clearly.

Strict rule: fields are never coerced. A bool must be a JSON boolean, an int an integer, a
str a string (a float field takes an integer too): a signed status ``{"online": "no"}`` is
refused with its reason, not read as offline (pydantic's strict mode on :class:`Message`).

Validation rule: a message class checks everything it can know by itself (bitset lengths
against ``size``, section lengths against the masks, sample counts within
:data:`MAX_SAMPLES`, a ciphertext exactly when a mask selects positions), so a typed
message that exists is internally consistent; :func:`update_from_message` and
:func:`aggregate_from_message` add what the receiver knows (the model's size, the key).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, model_validator

from senseshield.engine.aggregation import EncryptedAggregate, ProtectedUpdate, validate_update
from senseshield.errors import ProtocolError
from senseshield.he.base import PublicKey
from senseshield.runtime.protocol.envelope import Frame, encode_frame
from senseshield.registry import Registry


class Message(BaseModel):
    """Base of all messages. Array fields are declared in ``sections``."""

    # strict: no coercion of what arrives ("no" is not False, "12" is not 12, 1.0 is not 1)
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, strict=True)

    schema_name: ClassVar[str]
    version: ClassVar[int] = 1
    sections: ClassVar[dict[str, str]] = {}  # field name -> "f32" | "f64" | "u8" | "bytes"
    # whether a receiver keeps the signed frame's bytes (Frame.raw) after checking its
    # signature, e.g. to forward it; others let them go (Frame.release_signed)
    keeps_raw: ClassVar[bool] = False


MESSAGES: Registry[type[Message]] = Registry("message schema")

MAX_SAMPLES = 1 << 24
"""Most training samples a device may claim (hello, updates): 16.7 million. The coordinator
also requires an update's count to equal the agent's hello."""


def message(cls: type[Message]) -> type[Message]:
    """Class decorator: register a message under its ``schema_name``."""
    return MESSAGES.register(cls.schema_name)(cls)


def pack_mask(mask: np.ndarray) -> np.ndarray:
    return np.packbits(np.asarray(mask, dtype=bool))


def unpack_mask(bits: np.ndarray, size: int) -> np.ndarray:
    """The bool mask of a bitset of ``size`` positions; :class:`ProtocolError` unless the
    bitset has exactly ``ceil(size / 8)`` bytes and its padding bits are zero."""
    if bits.size != -(-size // 8):
        raise ProtocolError(f"A mask of {size} positions needs {-(-size // 8)} bytes, got {bits.size}.")
    unpacked = np.unpackbits(bits).astype(bool)
    if unpacked[size:].any():
        raise ProtocolError(f"A mask of {size} positions has padding bits set after position {size}.")
    return unpacked[:size]


def to_frame(msg: Message, *, fleet: str, sender: str, round: int, signer: Any = None,
             pieces: dict[str, list[bytes]] | None = None) -> bytes:
    """Serialise ``msg`` into one envelope frame, signed by ``signer`` (an
    :class:`~senseshield.runtime.identity.Identity`) if given. ``pieces``: bytes sections the
    message leaves empty, given as pieces the frame holds one after another (a large section,
    e.g. :func:`frame_list` of a fleet's receipts, is then never joined on its own)."""
    data = msg.model_dump()
    sections = {name: data.pop(name) for name in msg.sections}
    for name, parts in (pieces or {}).items():
        if msg.sections.get(name) != "bytes" or sections[name]:
            raise ValueError(f"Section {name!r} of {msg.schema_name!r} is not an empty bytes section; "
                             "only those are given as pieces.")
        sections[name] = list(parts)
    return encode_frame(
        schema=msg.schema_name, version=msg.version, fleet=fleet, sender=sender,
        round=round, fields=data, sections=sections, signer=signer,
    )


def from_frame(frame: Frame) -> Message:
    """The typed message of a decoded frame; :class:`ProtocolError` if it does not fit."""
    cls = MESSAGES.find(frame.schema)
    if cls is None:
        raise ProtocolError(f"Unknown message schema {frame.schema!r}.")
    if frame.version != cls.version:
        older = "the sender" if frame.version < cls.version else "this receiver"
        raise ProtocolError(
            f"Message {frame.schema!r} has version {frame.version}; this build speaks version "
            f"{cls.version}, so {older} is out of date."
        )
    clash = set(frame.fields) & set(frame.sections)
    if clash:
        raise ProtocolError(f"Message {frame.schema!r} names {sorted(clash)} both as field and as section.")
    if set(frame.sections) != set(cls.sections):
        raise ProtocolError(
            f"Message {frame.schema!r} carries sections {sorted(frame.sections)}; "
            f"expected {sorted(cls.sections)}."
        )
    for name, kind in cls.sections.items():
        value = frame.sections[name]
        ok = isinstance(value, bytes) if kind == "bytes" else (
            isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == _NUMPY[kind]
        )
        if not ok:
            raise ProtocolError(f"Section {name!r} of {frame.schema!r} must be a 1-D {kind} array.")
    try:
        return cls(**frame.fields, **frame.sections)
    except ValidationError as exc:
        first = exc.errors()[0]
        error = first.get("ctx", {}).get("error")
        if isinstance(error, ProtocolError):  # a class's own consistency check
            raise ProtocolError(f"Message {frame.schema!r}: {error}") from None
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(f"Message {frame.schema!r}: field {where!r} {first['msg'].lower()}.") from None


_NUMPY = {"f32": np.dtype("f4"), "f64": np.dtype("f8"), "u8": np.dtype("u1"), "i64": np.dtype("i8")}


# ---- the messages ---------------------------------------------------------------------------


@message
class PublicKeyAnnouncement(Message):
    """``keys/public`` (retained): the key server's public material. Never a secret.

    ``refused`` (version 2): the key server will not serve job ``run_id`` and says why in one
    sentence (e.g. the job is not signed by an operator the trust file pins); the coordinator
    fails the job with it, agents ignore the announcement."""

    schema_name: ClassVar[str] = "public-key"
    version: ClassVar[int] = 2
    sections: ClassVar[dict[str, str]] = {"key": "bytes"}
    scheme: str
    key_id: str
    key: bytes
    run_id: str = ""  # the job (FleetConfig.run_id) this key serves; agents join with it
    refused: str = Field("", max_length=2000)


@message
class Status(Message):
    """``agents/<id>/status`` (retained; also the MQTT last will)."""

    schema_name: ClassVar[str] = "status"
    online: bool


@message
class Hello(Message):
    """``agents/<id>/hello``: the agent's measured profile and data facts."""

    schema_name: ClassVar[str] = "hello"
    version: ClassVar[int] = 2
    run_id: str  # the fleet run the agent joins (FleetConfig.run_id)
    agent_id: str
    n_samples: int = Field(ge=1, le=MAX_SAMPLES)
    bandwidth: float = Field(gt=0)  # r_i, MB/s
    cpu_speed: float = Field(gt=0)  # v_i, GHz x cores
    profile: dict[str, Any] = {}
    key_id: str | None = None  # the public key the agent holds
    index: int = Field(0, ge=0)  # the agent's data shard index (seeds its randomness)
    box_key: str = ""  # base64 X25519 key the key server seals round challenges to (trust file wins)


@message
class BootstrapVector(Message):
    """Agent -> coordinator once: the (DP-noised) sensitivity vector for clustering."""

    schema_name: ClassVar[str] = "bootstrap"
    sections: ClassVar[dict[str, str]] = {"sensitivity": "f64"}
    sensitivity: np.ndarray


@message
class FleetConfig(Message):
    """``fleet/config`` (retained, coordinator): the run every service and agent follows.

    ``config`` is a :class:`senseshield.job.Job` as JSON (a fleet run is
    the simulation of the same config, run by processes); ``initial`` is the round-0 model,
    built by the coordinator exactly as the simulator builds it; ``run_id`` is new each run.
    ``submission`` (version 2): the operator's signed ``jobs/submit`` frame of this job, as
    the operator sent it (empty: an unsigned job); the key server serves the run only if an
    operator the trust file pins signed it and ``config`` is that job
    (:mod:`senseshield.runtime.jobsig`).
    """

    schema_name: ClassVar[str] = "fleet-config"
    version: ClassVar[int] = 2
    sections: ClassVar[dict[str, str]] = {"initial": "f64", "submission": "bytes"}
    run_id: str
    config: dict[str, Any]
    input_shape: list[int]
    num_classes: int = Field(ge=1)  # a regression's targets may be 1
    round_deadline: float = Field(gt=0)
    initial: np.ndarray
    submission: bytes = b""

    @model_validator(mode="after")
    def _outputs(self) -> "FleetConfig":
        task = self.config.get("task") or "classification"
        if task == "classification" and self.num_classes < 2:
            raise ValueError(f"num_classes {self.num_classes} is below 2, which a classification job needs")
        return self


@message
class Assignment(Message):
    """``agents/<id>/inbox`` once after bootstrap: the agent's cluster and encryption budget."""

    schema_name: ClassVar[str] = "assignment"
    cluster: int = Field(ge=0)
    encryption_budget: float = Field(ge=0, le=1)


@message
class RoundPlan(Message):
    """``agents/<id>/inbox``: what the agent does this round (the round is in the header)."""

    schema_name: ClassVar[str] = "round-plan"
    sections: ClassVar[dict[str, str]] = {"shared_mask": "u8"}
    cluster: int = Field(ge=0)
    encryption_budget: float = Field(ge=0, le=1)
    deadline: float  # seconds since the epoch, coordinator clock
    block_size: int = Field(ge=1)
    size: int = Field(ge=1)
    model_round: int = Field(0, ge=0)  # version of the cluster model to start from (0: initial)
    negotiate: bool = False  # send a proposal first and wait for the shared mask
    participants: int = Field(1, ge=1)  # |K^t| of the agent's cluster
    noise_multiplier: float | None = None  # user-level sigma
    record_noise: float | None = None  # this agent's DP-SGD sigma
    local_steps: int | None = Field(None, ge=1)  # partial work: train only this many minibatch steps (None: full)
    ring_bits: int = 64  # masked scheme: mask modulo 2^32 or 2^64 (Strategy.ring_bits of the cluster)
    has_shared_mask: bool = False
    shared_mask: np.ndarray  # bitset; empty when has_shared_mask is False

    @model_validator(mode="after")
    def _consistent(self) -> "RoundPlan":
        if self.ring_bits not in (32, 64):
            raise ProtocolError(f"A round plan's ring_bits is {self.ring_bits}; the masked scheme has rings of 32 and 64 bits.")
        if self.has_shared_mask:
            unpack_mask(self.shared_mask, self.size)
        elif self.shared_mask.size:
            raise ProtocolError("A round plan without a shared mask carries mask bytes.")
        if self.block_size > self.size:
            raise ProtocolError(f"Block size {self.block_size} exceeds the model's {self.size} parameters.")
        return self

    def mask(self) -> np.ndarray | None:
        return unpack_mask(self.shared_mask, self.size) if self.has_shared_mask else None

    def digest(self) -> str:
        """SHA-256 of everything this plan asks of the device (every field but the deadline,
        which a re-sent plan may move): it enters the masked scheme's pad key and the
        receipt, so a pad made under one plan is worthless under another."""
        import hashlib
        import json

        fields = self.model_dump(mode="json", exclude={"deadline", "shared_mask"})
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
        digest.update(b"\0" + np.ascontiguousarray(self.shared_mask, dtype=np.uint8).tobytes())
        return digest.hexdigest()


@message
class Proposal(Message):
    """``agents/<id>/proposal``: a negotiating strategy's proposed positions (bitset)."""

    schema_name: ClassVar[str] = "proposal"
    sections: ClassVar[dict[str, str]] = {"proposal": "u8"}
    cluster: int = Field(ge=0)
    size: int = Field(ge=1)
    proposal: np.ndarray

    @model_validator(mode="after")
    def _consistent(self) -> "Proposal":
        unpack_mask(self.proposal, self.size)
        return self


@message
class MaskDecision(Message):
    """``agents/<id>/inbox``: the cluster's consensus mask after the proposals."""

    schema_name: ClassVar[str] = "mask-decision"
    sections: ClassVar[dict[str, str]] = {"shared_mask": "u8"}
    cluster: int = Field(ge=0)
    size: int = Field(ge=1)
    shared_mask: np.ndarray

    @model_validator(mode="after")
    def _consistent(self) -> "MaskDecision":
        unpack_mask(self.shared_mask, self.size)
        return self


@message
class Metrics(Message):
    """``agents/<id>/metrics``: after applying a round's model, the agent's value of the job's
    metric on its test split (``metric``: accuracy, mse, ...; ``metrics``: every evaluation
    metric; the round's ``training_*`` metrics travel with its update) and its phase timings (seconds); ``epsilon`` is its DP-SGD accountant's
    RDP figure and ``dp_history`` that accountant's history (noise multiplier, sample rate,
    steps), from which the coordinator computes the run's final figures by PLD too."""

    schema_name: ClassVar[str] = "metrics"
    version: ClassVar[int] = 3
    cluster: int = Field(ge=0)
    metric: float = Field(allow_inf_nan=False)
    metrics: dict[str, float] = {}
    n_test: int = Field(ge=0)
    timings: dict[str, float] = {}
    epsilon: float | None = None
    # JSON has no tuples: each entry arrives as a list (its items are still strict)
    dp_history: list[Annotated[tuple[float, float, int], Strict(False)]] = []
    inference: dict[str, float] = {}  # onnxruntime latency of the model: p50/p95 ms, batch 1 and 32


@message
class Notice(Message):
    """``agents/<id>/inbox`` or ``fleet/control``: ``refused`` (with the reason), ``done``,
    ``cancelled`` (the job was cancelled), or ``resend-metrics`` (a resumed coordinator asks
    for the metrics it may have missed)."""

    schema_name: ClassVar[str] = "notice"
    run_id: str = ""
    kind: str = Field(pattern="^(refused|done|cancelled|resend-metrics)$")
    reason: str = ""


@message
class Ack(Message):
    """``agents/<id>/inbox``: the coordinator has what the device sent of job ``run_id``.
    ``of`` ``hello``: its hello, and its bootstrap vector when the job needs one (the device
    is ready to be planned); ``update``: its update of the header's round, counted, a
    duplicate, late or refused (``reason``, one sentence, says why it does not count). A
    device re-sends a hello or an update until it is acknowledged (docs/protocol.md,
    "Re-sending"); an acknowledged one is never sent again."""

    schema_name: ClassVar[str] = "ack"
    run_id: str
    of: str = Field(pattern="^(hello|update)$")
    reason: str = Field("", max_length=2000)


@message
class Decline(Message):
    """``agents/<id>/decline``: the agent does not take part in job ``run_id`` (its data does
    not fit the job, it is not selected, ...) and says why in one sentence. It stays
    available for the next job."""

    schema_name: ClassVar[str] = "decline"
    run_id: str
    reason: str = Field(max_length=2000)
    selected: bool = True  # False: the job's selection leaves this device out (not an error)


@message
class RoundFailure(Message):
    """``agents/<id>/failure``: the agent could not finish round ``round`` of job ``run_id``
    and says why in one sentence. ``phase`` (version 2): ``round`` (its training or another
    step of the round raised: the coordinator closes the round without it at once, as it does
    for an agent whose last will fired, instead of waiting for the deadline) or ``evaluation``
    (applying or evaluating the round's model raised: the device has no metrics of it). The
    agent stays in the job; the coordinator shows the sentence to the operator."""

    schema_name: ClassVar[str] = "failure"
    version: ClassVar[int] = 2
    run_id: str
    reason: str = Field(max_length=2000)
    phase: str = Field("round", pattern="^(round|evaluation)$")


@message
class JobSubmit(Message):
    """``jobs/submit`` (operator -> coordinator): a job to queue (a :class:`senseshield.job.Job`
    as JSON); the answer goes to ``jobs/replies/<request_id>``.

    ``nonce`` (version 2): the job's id and run id, drawn by the operator's machine when it
    signs the job: the coordinator cannot choose a run id, and the key server serves each
    nonce as one job only. ``initial_digest``: SHA-256 of the job's float32 initial model
    (:func:`senseshield.he.base.model_digest`), which the key server and every device check
    against the model the coordinator forwards (:func:`senseshield.runtime.jobsig.job_refusal`)."""

    schema_name: ClassVar[str] = "job-submit"
    version: ClassVar[int] = 2
    keeps_raw: ClassVar[bool] = True  # the coordinator keeps the operator's signed frame with the job
    request_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    job: dict[str, Any]
    nonce: str = Field("", pattern=r"^(j-[0-9a-f]{16})?$")
    initial_digest: str = Field("", pattern=r"^([0-9a-f]{64})?$")


@message
class JobCancel(Message):
    """``jobs/cancel`` (operator -> coordinator): cancel a queued or running job."""

    schema_name: ClassVar[str] = "job-cancel"
    request_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    job_id: str = Field(max_length=64)


@message
class JobReply(Message):
    """``jobs/replies/<request_id>`` (coordinator -> operator): accepted (with the job id) or
    refused with the reason (one sentence naming the key and what is allowed)."""

    schema_name: ClassVar[str] = "job-reply"
    request_id: str
    accepted: bool
    job_id: str = ""
    reason: str = ""


@message
class JobBoard(Message):
    """``jobs/board`` (retained, coordinator): every job it knows, newest last, with its
    state (queued, waiting, running, done, failed, cancelled), progress and event lines."""

    schema_name: ClassVar[str] = "job-board"
    jobs: list[dict[str, Any]]


@message
class ClusterModel(Message):
    """``clusters/<c>/model`` (retained): the cluster's global model after a round."""

    schema_name: ClassVar[str] = "cluster-model"
    # float32: what the model's parameters hold anyway (the key server keeps float64)
    sections: ClassVar[dict[str, str]] = {"weights": "f32"}
    run_id: str
    cluster: int = Field(ge=0)
    model: str
    weights: np.ndarray


@message
class UpdateMessage(Message):
    """``rounds/<r>/updates/<id>``: a protected update (see :class:`ProtectedUpdate`).
    ``training`` (version 3): the device's ``training_*`` metrics of the local training this
    update comes from (loss, accuracy on its training data), so every round's report has its
    own, whenever the device evaluates the model."""

    schema_name: ClassVar[str] = "update"
    version: ClassVar[int] = 3
    sections: ClassVar[dict[str, str]] = {
        "mask": "u8", "withheld": "u8", "plaintext": "f32", "ciphertext": "bytes", "receipt": "bytes",
    }
    cluster: int = Field(ge=0)
    n_samples: int = Field(ge=1, le=MAX_SAMPLES)
    size: int = Field(ge=1)
    has_withheld: bool = False
    timings: dict[str, float] = {}
    report: dict[str, Any] = {}  # mask diagnostics: zone ratios, feasibility (no values)
    training: dict[str, float] = {}  # (version 3) training_* metrics of the round's local training
    mask: np.ndarray
    withheld: np.ndarray
    plaintext: np.ndarray
    ciphertext: bytes
    receipt: bytes = b""  # a Receipt frame signed by the agent, for the key server (see Receipt)

    @model_validator(mode="after")
    def _consistent(self) -> "UpdateMessage":
        mask = unpack_mask(self.mask, self.size)
        sent = self.size - int(mask.sum())
        if self.has_withheld:
            withheld = unpack_mask(self.withheld, self.size)
            if np.any(withheld & mask):
                raise ProtocolError("An update marks positions as both encrypted and withheld.")
            sent -= int(withheld.sum())
        elif self.withheld.size:
            raise ProtocolError("An update without withheld positions carries a withheld mask.")
        if self.plaintext.size != sent:
            raise ProtocolError(f"An update has {self.plaintext.size} plaintext values; its masks leave {sent}.")
        if not np.all(np.isfinite(self.plaintext)):
            raise ProtocolError("An update holds NaN or inf in its plaintext part.")
        if bool(self.ciphertext) != bool(mask.any()):
            raise ProtocolError("An update must carry a ciphertext exactly when its mask selects positions.")
        return self


RECEIPT_BATCH_BYTES = 512 << 10
"""The receipts a :class:`ReceiptBatch` carries at most (bytes): well under a broker message
and a chunk, so a batch is never reassembled."""


@message
class ReceiptBatch(Message):
    """``keyserver/requests``, before the :class:`AggregateRequest` that names it: part of a
    large aggregate's signed receipts (pack_frames), batch ``index`` of the request's
    ``attempt``. The key server checks each receipt as its batch arrives and keeps what its
    checks read of it, so neither side holds a fleet's receipts in one message."""

    schema_name: ClassVar[str] = "receipt-batch"
    version: ClassVar[int] = 1
    sections: ClassVar[dict[str, str]] = {"receipts": "bytes"}
    run_id: str
    cluster: int = Field(ge=0)
    attempt: str = Field(pattern=r"^[0-9a-f]{32}$")
    index: int = Field(ge=0)
    receipts: bytes


@message
class AggregateRequest(Message):
    """``keyserver/requests``: a cluster's aggregate, for the key server to decrypt.

    ``plains`` (version 4, verifiable schemes): every contributor's plaintext part
    (:func:`plain_part`, each checked against the digest its receipt signs), in the order of
    sorted(contributors); the key server recomputes from them, the signed masks and sample
    counts what the aggregate adds in plaintext (``plain_fold``, ``plain_sum``,
    ``position_weight``, ``thin_sum``) and refuses an aggregate that declares anything else.

    ``batches`` (version 5): the receipts came before it in that many :class:`ReceiptBatch`
    messages of its ``attempt`` (``receipts`` is then empty); 0: they are in ``receipts``."""

    schema_name: ClassVar[str] = "aggregate-request"
    version: ClassVar[int] = 5
    sections: ClassVar[dict[str, str]] = {
        "union_mask": "u8", "plain_sum": "f64", "position_weight": "f64", "ciphertext": "bytes",
        "receipts": "bytes", "plain_fold": "bytes", "masks": "u8", "thin_sum": "f64", "plains": "bytes",
    }
    run_id: str
    cluster: int = Field(ge=0)
    size: int = Field(ge=1)
    total_weight: int = Field(ge=1)
    contributors: list[str]
    union_mask: np.ndarray
    plain_sum: np.ndarray
    position_weight: np.ndarray  # empty when every client sent every position
    ciphertext: bytes
    receipts: bytes = b""  # the contributors' signed Receipt frames (pack_frames)
    plain_fold: bytes = b""  # per ciphertext unit, the plaintext the coordinator folded in (verifiable schemes)
    # (version 3, per-client-mask schemes) every contributor's packed mask, in the order of
    # sorted(contributors), for the key server to count encryptors per position; and the
    # plaintext senders' sums at the union positions fewer than the job's min_encryptors encrypted
    masks: np.ndarray = Field(default_factory=lambda: np.zeros(0, np.uint8))
    thin_sum: np.ndarray = Field(default_factory=lambda: np.zeros(0))
    plains: bytes = b""  # (version 4) the contributors' plaintext parts (pack_frames of plain_part), sorted by name
    attempt: str = Field("", pattern=r"^([0-9a-f]{32})?$")  # (version 5) its receipt batches' attempt
    batches: int = Field(0, ge=0)  # (version 5) receipt batches sent before it (0: receipts inline)

    @model_validator(mode="after")
    def _consistent(self) -> "AggregateRequest":
        if self.batches and (self.receipts or not self.attempt):
            raise ProtocolError("An aggregate whose receipts came in batches names their attempt and carries none itself.")
        union = unpack_mask(self.union_mask, self.size)
        left = self.size - int(union.sum())
        if self.plain_sum.size != left:
            raise ProtocolError(f"An aggregate has {self.plain_sum.size} plaintext sums; its union mask leaves {left}.")
        if not np.all(np.isfinite(self.plain_sum)):
            raise ProtocolError("An aggregate holds NaN or inf in its plaintext sums.")
        w = self.position_weight
        if w.size not in (0, self.size):
            raise ProtocolError(f"An aggregate has {w.size} position weights; it needs 0 or {self.size}.")
        if w.size and (np.any(w < 0) or np.any(w > self.total_weight) or np.any(w != np.round(w))):
            raise ProtocolError(f"An aggregate's position weights must be integers in 0..{self.total_weight}.")
        distinct = len(set(self.contributors))  # a name given twice counts once (key server's rule)
        if not distinct or distinct > self.total_weight:
            raise ProtocolError(f"An aggregate of {distinct} contributors cannot weigh {self.total_weight}.")
        if bool(self.ciphertext) != bool(union.any()):
            raise ProtocolError("An aggregate must carry a ciphertext exactly when its union mask selects positions.")
        if not np.all(np.isfinite(self.thin_sum)):
            raise ProtocolError("An aggregate holds NaN or inf in its thin sums.")
        return self

    def contributor_masks(self) -> dict[str, np.ndarray]:
        """Every contributor's packed mask (as its update carried it), from section ``masks``;
        empty if none were sent."""
        if not self.masks.size:
            return {}
        per = (self.size + 7) // 8
        names = sorted(set(self.contributors))
        if self.masks.size != per * len(names):
            raise ProtocolError(f"The aggregate carries {self.masks.size} bytes of masks; {len(names)} contributors "
                                f"need {per * len(names)}.")
        masks = {a: self.masks[i * per : (i + 1) * per] for i, a in enumerate(names)}
        for m in masks.values():
            unpack_mask(m, self.size)  # padding bits zero
        return masks

    def contributor_plains(self) -> dict[str, bytes]:
        """Every contributor's plaintext part (:func:`plain_part`, as its update carried it),
        from section ``plains``; empty if none were sent."""
        if not self.plains:
            return {}
        names = sorted(set(self.contributors))
        parts = unpack_frames(self.plains, limit=plain_part_limit(self.size))
        if len(parts) != len(names):
            raise ProtocolError(f"The aggregate carries {len(parts)} plaintext parts for {len(names)} contributors.")
        return dict(zip(names, parts))


@message
class Receipt(Message):
    """An agent's signed statement about its update, carried inside the update (section
    ``receipt``) and forwarded by the coordinator with the aggregate: the key server counts
    only contributors whose receipt verifies against the trust file, once per round, for the
    cluster they signed, and (Paillier schemes) checks the aggregate against the
    ``fingerprint`` under the round's sealed challenge (:mod:`senseshield.he.fingerprint`).
    The round is the frame header's. ``start_digest`` (version 2) is the SHA-256 of the
    float32 model the update was trained from: the key server decrypts a contribution of
    one (key, agent, starting model) in one aggregate only, across jobs (no differencing of
    re-run jobs). ``shares`` (version 3, distributed DP): the number of contributors the
    agent sized its noise share for; the key server decrypts no sum of fewer contributors,
    so every sum it unmasks carries at least the job's noise, whatever the coordinator
    planned. ``plan_digest`` (version 4): :meth:`RoundPlan.digest` of the plan the update was
    made under; the masked scheme's pads of this contribution are derived with it
    (:func:`senseshield.he.base.round_context`), so the key server removes them with it.
    ``plain_digest`` (version 4): the SHA-256 of the update's plaintext part
    (:func:`plain_part`: its withheld bitset and its float32 ``plaintext`` section as sent);
    the key server recomputes what the aggregate adds in plaintext from these parts."""

    schema_name: ClassVar[str] = "receipt"
    version: ClassVar[int] = 4
    sections: ClassVar[dict[str, str]] = {"fingerprint": "bytes"}
    run_id: str
    cluster: int = Field(ge=0)
    n_samples: int = Field(ge=1, le=MAX_SAMPLES)
    key_id: str = ""
    mask_digest: str = Field(max_length=64)  # SHA-256 of the packed encryption mask
    ciphertext_digest: str = Field(max_length=64)  # SHA-256 of the ciphertext bytes ("" if none)
    fingerprint: bytes = b""  # empty when nothing is encrypted or the scheme is not verifiable
    start_digest: str = Field("", max_length=64)  # SHA-256 of the float32 model trained from
    shares: int = Field(0, ge=0, le=1 << 20)  # distributed DP: contributors its noise share is sized for (0: none)
    plan_digest: str = Field("", max_length=64)  # RoundPlan.digest() of the plan it was made under
    plain_digest: str = Field("", max_length=64)  # SHA-256 of the update's plain_part (withheld bitset, plaintext)


@message
class RoundOpen(Message):
    """``keyserver/rounds`` (coordinator -> key server) when a round starts: which agents are in
    which cluster. The key server pins it (a second, different plan for the round is refused),
    accepts aggregates only for these clusters and members, and seals the round's challenge
    seed to these agents. ``box_keys`` (base64 X25519) are used only without a trust file."""

    schema_name: ClassVar[str] = "round-open"
    run_id: str
    clusters: dict[str, list[str]]
    box_keys: dict[str, str] = {}


@message
class Challenge(Message):
    """``keyserver/challenges`` (retained, key server): round's challenge seed, sealed to each
    agent of the round (base64; X25519 + ChaCha20-Poly1305 under the key server's ``box_key``),
    so the coordinator that relays it cannot read it. The round is in the header."""

    schema_name: ClassVar[str] = "challenge"
    run_id: str
    box_key: str
    sealed: dict[str, str]


@message
class AggregateResult(Message):
    """``keyserver/results/<r>``: accepted (model published) or refused, with the reason.

    ``retry``: refused before anything was decrypted or spent, because the aggregate does not
    match the signed fingerprints (verifiable schemes): the coordinator may send the round's
    aggregate again without (or with another update of) one contributor, to find the one at
    fault. ``excluded``: on a verdict after such a refusal, the contributors whose update the
    key server found at fault (agent -> why): the updates in the refused attempt that the
    accepted one left out or replaced."""

    schema_name: ClassVar[str] = "aggregate-result"
    run_id: str
    cluster: int = Field(ge=0)
    accepted: bool
    reason: str = ""
    timings: dict[str, float] = {}  # key server's decrypt and apply seconds
    retry: bool = False
    excluded: dict[str, str] = {}


@message
class SitePartial(Message):
    """``sites/<site>/partial``: a site aggregator's partial sum of one cluster's round (the
    round is in the header): the running aggregate of its site's updates
    (:mod:`senseshield.engine.partial`: JSON ``state`` and ``arrays``, an ``.npz`` of 1-D
    arrays), each contributor's signed receipt (``receipts``, :func:`pack_frames`, in the
    order of ``state["contributors"]``, which is sorted) and what the report keeps of each
    update (``notes``: a JSON list in the same order). Sent by ``site-<site>``."""

    schema_name: ClassVar[str] = "site-partial"
    sections: ClassVar[dict[str, str]] = {"arrays": "bytes", "receipts": "bytes", "notes": "bytes"}
    run_id: str
    site: str = Field(min_length=1, max_length=64)
    cluster: int = Field(ge=0)
    size: int = Field(ge=1)
    state: dict[str, Any]
    arrays: bytes
    receipts: bytes
    notes: bytes


# ---- conversions between engine objects and messages ---------------------------------------


def update_to_message(
    update: ProtectedUpdate, public_key: PublicKey | None, *, report: dict[str, Any] | None = None,
    receipt: bytes = b"",
) -> UpdateMessage:
    cipher = b""
    if update.ciphertext is not None:
        assert public_key is not None, "an encrypted update needs the public key to serialise"
        cipher = public_key.ciphertext_bytes(update.ciphertext)
    withheld = update.withheld
    return UpdateMessage(
        cluster=update.cluster,
        n_samples=update.n_samples,
        size=update.size,
        has_withheld=withheld is not None,
        timings=update.timings,
        report=report or {},
        mask=pack_mask(update.mask),
        withheld=pack_mask(withheld) if withheld is not None else np.zeros(0, np.uint8),
        plaintext=np.asarray(update.plaintext, dtype=np.float32),
        ciphertext=cipher,
        receipt=receipt,
    )


def update_from_message(
    msg: UpdateMessage, public_key: PublicKey | None, *, client_id: str, round: int, size: int
) -> ProtectedUpdate:
    """Rebuild the engine's update for a model of ``size`` parameters, checked completely
    (:func:`validate_update`: shapes, masks, finiteness; the ciphertext against
    ``public_key`` and the mask) before anyone uses it; :class:`ProtocolError` otherwise."""
    if msg.size != size:
        raise ProtocolError(f"Update of {client_id!r} has {msg.size} parameters; the model has {size}.")
    ciphertext = None
    if msg.ciphertext:
        if public_key is None:
            raise ProtocolError(f"Update from {client_id!r} is encrypted but no public key is known.")
        ciphertext = public_key.vector_from_bytes(msg.ciphertext)
        public_key.check(ciphertext)
    update = ProtectedUpdate(
        client_id=client_id,
        round=round,
        cluster=msg.cluster,
        n_samples=msg.n_samples,
        size=msg.size,
        mask=unpack_mask(msg.mask, msg.size),
        ciphertext=ciphertext,
        plaintext=msg.plaintext.astype(np.float32),
        timings=dict(msg.timings),
        withheld=unpack_mask(msg.withheld, msg.size) if msg.has_withheld else None,
    )
    validate_update(update, size=size, round=round)
    return update


def aggregate_to_message(
    aggregate: EncryptedAggregate, public_key: PublicKey | None, *, run_id: str, receipts: list[bytes] | None = None,
    min_encryptors: int = 1,
) -> AggregateRequest:
    cipher, fold = b"", b""
    if aggregate.ciphertext is not None:
        assert public_key is not None
        cipher = public_key.ciphertext_bytes(aggregate.ciphertext)
        if public_key.verifiable:
            fold = public_key.plain_fold(aggregate.ciphertext)
    weights = aggregate.position_weight
    masks = aggregate.masks or {}
    plains = aggregate.plains or {}
    return AggregateRequest(
        plains=pack_frames([plain_part(pack_mask(w) if w is not None else np.zeros(0, np.uint8), p)
                            for w, p in (plains[a] for a in sorted(plains))]),
        masks=np.concatenate([masks[a] for a in sorted(masks)]) if masks else np.zeros(0, np.uint8),
        thin_sum=np.asarray(aggregate.thin_sum if aggregate.thin_sum is not None else [], dtype=np.float64),
        run_id=run_id,
        cluster=aggregate.cluster,
        size=aggregate.size,
        total_weight=aggregate.total_weight,
        contributors=list(aggregate.contributors),
        union_mask=pack_mask(aggregate.union_mask),
        plain_sum=np.asarray(aggregate.plain_sum, dtype=np.float64),
        position_weight=np.zeros(0) if weights is None else np.asarray(weights, dtype=np.float64),
        ciphertext=cipher,
        receipts=pack_frames(receipts or []),
        plain_fold=fold,
    )


def aggregate_from_message(
    msg: AggregateRequest, public_key: PublicKey | None, *, round: int, size: int
) -> EncryptedAggregate:
    """The engine's aggregate for a model of ``size`` parameters; sections were checked by
    the message class, the ciphertext (key, block count and size, positions = union mask)
    is checked here, before anything is decrypted."""
    if msg.size != size:
        raise ProtocolError(f"Aggregate of cluster {msg.cluster} has {msg.size} parameters; the model has {size}.")
    union = unpack_mask(msg.union_mask, msg.size)
    ciphertext = None
    if msg.ciphertext:
        if public_key is None:
            raise ProtocolError("The aggregate is encrypted but no public key is known.")
        ciphertext = public_key.vector_from_bytes(msg.ciphertext)
        public_key.check(ciphertext)
        if not np.array_equal(ciphertext.positions, np.flatnonzero(union)):
            raise ProtocolError(f"Aggregate of cluster {msg.cluster}: ciphertext does not match its union mask.")
    return EncryptedAggregate(
        round=round,
        cluster=msg.cluster,
        size=msg.size,
        union_mask=union,
        ciphertext=ciphertext,
        plain_sum=msg.plain_sum,
        total_weight=msg.total_weight,
        contributors=list(msg.contributors),
        position_weight=msg.position_weight if msg.position_weight.size else None,
    )


def pack_frames(frames: list[bytes]) -> bytes:
    """Frames one after another, each preceded by its u32 big-endian length."""
    return b"".join(frame_list(frames))


def frame_list(frames: list[bytes]) -> list[bytes]:
    """The pieces of :func:`pack_frames` (each frame's length, then the frame), not joined:
    for :func:`to_frame`'s ``pieces``."""
    return [part for f in frames for part in (len(f).to_bytes(4, "big"), f)]


def unpack_frames(data: bytes, *, limit: int = 1 << 16) -> list[bytes]:
    """Inverse of :func:`pack_frames`; :class:`ProtocolError` on a malformed list."""
    return list(iter_frames(data, limit=limit))


def iter_frames(data: bytes, *, limit: int = 1 << 16) -> Iterator[bytes]:
    """:func:`unpack_frames` one frame at a time: a reader that keeps what it needs of each
    holds no copy of the whole list. :class:`ProtocolError` when it reaches a malformed part."""
    i = 0
    while i < len(data):
        if i + 4 > len(data):
            raise ProtocolError("A frame list ends inside a length prefix.")
        size = int.from_bytes(data[i : i + 4], "big")
        if size > limit or i + 4 + size > len(data):
            raise ProtocolError(f"A frame list holds a frame of {size:,} bytes that does not fit.")
        yield data[i + 4 : i + 4 + size]
        i += 4 + size


def plain_part(withheld: np.ndarray, plaintext: np.ndarray) -> bytes:
    """An update's plaintext part, as its receipt signs it (``Receipt.plain_digest``) and an
    aggregate request carries it (``AggregateRequest.plains``): the length of the withheld
    bitset (u32 big-endian; 0: nothing withheld), the bitset (the update's ``withheld``
    section), then the float32 values of its ``plaintext`` section as sent (little-endian)."""
    bits = np.asarray(withheld, dtype=np.uint8).tobytes()
    return len(bits).to_bytes(4, "big") + bits + np.asarray(plaintext, dtype="<f4").tobytes()


def plain_digest(withheld: np.ndarray, plaintext: np.ndarray) -> str:
    """SHA-256 (hex) of :func:`plain_part`: what a receipt signs of its update's plaintext."""
    return hashlib.sha256(plain_part(withheld, plaintext)).hexdigest()


def plain_part_limit(size: int) -> int:
    """The most bytes a :func:`plain_part` of a model of ``size`` parameters can take."""
    return 4 + -(-size // 8) + 4 * size


def parse_plain_part(data: bytes, size: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Inverse of :func:`plain_part` for a model of ``size`` parameters: the withheld mask
    (None: nothing withheld) and the float32 plaintext values; :class:`ProtocolError` if it
    does not fit (the engine checks the values against the contributor's mask)."""
    if len(data) < 4:
        raise ProtocolError("A plaintext part is shorter than its header.")
    n = int.from_bytes(data[:4], "big")
    if 4 + n > len(data) or (len(data) - 4 - n) % 4:
        raise ProtocolError(f"A plaintext part of {len(data)} bytes does not hold a {n}-byte bitset and float32 values.")
    withheld = unpack_mask(np.frombuffer(data, np.uint8, count=n, offset=4), size) if n else None
    return withheld, np.frombuffer(data, dtype="<f4", offset=4 + n).astype(np.float32)
