"""Operator-signed jobs: the coordinator alone cannot start a job.

A job is the operator's signed ``jobs/submit`` frame (a :class:`JobSubmit`, Ed25519-signed
by the operator's identity, naming the fleet, with a fresh nonce and its initial model's
digest). ``senseshield job submit`` sends one; ``senseshield job sign`` writes one to a file
(``coordinator serve --job FILE.signed``, ``fleet up``, Ansible's coordinator role). The
coordinator keeps the frame's bytes with the job, runs it under the signed nonce as its id,
and forwards the frame in ``fleet/config`` (:class:`FleetConfig` ``submission``); the key
server and every agent serve a run only if that frame is signed by a principal the trust
file pins with role ``operator``, for this fleet, the run's configuration is the signed job,
its run id is the signed nonce and its initial model the signed one (:func:`job_refusal`).
So a coordinator can neither invent a job (another seed, strategy or model to probe the
devices), nor move its initial model, nor choose or re-use a run id; the key server serves
each nonce as one job (docs/security.md).
"""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from senseshield.development import DEV_FLAG, DEVELOPMENT_ENV
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he.base import model_digest
from senseshield.job import Job, job_from_dict
from senseshield.runtime.identity import Identity, Trust, role_of_name
from senseshield.runtime.protocol.envelope import MAGIC, decode_frame
from senseshield.runtime.protocol.messages import JobSubmit, from_frame, to_frame

ALLOW_UNSIGNED = "--allow-unsigned-jobs"


def new_nonce() -> str:
    """A job's id and run id, drawn from the OS CSPRNG where the operator signs it (64 bits)."""
    return f"j-{secrets.token_hex(8)}"


def initial_digest(job: Job) -> str:
    """SHA-256 of ``job``'s float32 initial model (built from its seed and model, as the
    coordinator builds it), or "" when it cannot be built here (no input shape, or a model of
    the user's that only the fleet's hosts can import): the agents then rebuild it from the
    signed seed and model themselves (:func:`edge_agent.prepare.prepare`)."""
    from senseshield.job import initial_model

    if job.input_shape is None or job.num_classes is None:
        return ""
    try:
        _, weights = initial_model(job, tuple(job.input_shape), job.num_classes)
    except ConfigError:
        return ""
    return model_digest(weights)


def signed_initial(submission: bytes) -> str:
    """The initial model digest a submission signs ("" if none or no submission); its
    signature is :func:`job_refusal`'s to check."""
    message = _unchecked(submission)
    return message.initial_digest if message is not None else ""


def job_submission(job: Job) -> JobSubmit:
    """The :class:`JobSubmit` of ``job``: a fresh nonce (its run id) and its initial model's digest."""
    return JobSubmit(request_id=uuid.uuid4().hex[:12], job=job.model_dump(mode="json"), nonce=new_nonce(),
                     initial_digest=initial_digest(job))


def sign_job(job: Job, identity: Identity, *, fleet: str) -> bytes:
    """The signed :class:`JobSubmit` frame of ``job`` for ``fleet`` (what ``job sign`` writes),
    with a fresh nonce: each signature is one run; :class:`ConfigError` unless ``identity``
    is an operator's."""
    if role_of_name(identity.name) != "operator":
        raise ConfigError(f"--identity {identity.name!r} is not an operator's identity; a job is signed by an operator "
                          "('operator' or 'operator-...', the name the trust file pins).")
    return to_frame(job_submission(job), fleet=fleet, sender=identity.name, round=0, signer=identity)


def signed_nonce(data: bytes) -> str:
    """The nonce (job id) of a signed job's frame ("" if it carries none); the signature is
    checked by :func:`open_signed_job`."""
    message = _unchecked(data)
    return message.nonce if message is not None else ""


def _unchecked(data: bytes) -> JobSubmit | None:
    """The :class:`JobSubmit` a signed job's frame carries (None: none), its signature unchecked."""
    if not data:
        return None
    message = from_frame(decode_frame(data))
    return message if isinstance(message, JobSubmit) else None


def read_job_bytes(path: Path | str) -> bytes:
    """The bytes of a job file (signed or YAML/TOML); ConfigError naming it if unreadable."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"Job file {str(path)!r} cannot be read ({exc.strerror or exc}); give a signed, YAML or TOML "
                          "job file.") from None


def is_signed_job(data: bytes) -> bool:
    """True if ``data`` is a frame (a signed job file), not a YAML or TOML job."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def open_signed_job(data: bytes, trust: Trust, *, fleet: str) -> tuple[str, Job]:
    """(operator, job) of a signed job: a ``job-submit`` frame for ``fleet`` whose signature
    verifies under the key ``trust`` pins for its sender, a principal with role operator.
    :class:`ProtocolError` (or :class:`ConfigError` for a job that is not a valid job) naming
    what is wrong, as the end of a sentence ("it is ...")."""
    operator, job, _ = open_submission(data, trust, fleet=fleet)
    return operator, job


def open_submission(data: bytes, trust: Trust, *, fleet: str) -> tuple[str, Job, JobSubmit]:
    """:func:`open_signed_job` with the signed :class:`JobSubmit` itself (its nonce and initial digest)."""
    frame = decode_frame(data)
    if frame.schema != JobSubmit.schema_name:
        raise ProtocolError(f"it is a {frame.schema!r} frame, not a signed job ({JobSubmit.schema_name!r})")
    if frame.fleet != fleet:
        raise ProtocolError(f"it is signed for fleet {frame.fleet!r}, not {fleet!r}")
    if not frame.is_signed:
        raise ProtocolError(f"it is not signed (sender {frame.sender!r})")
    trust.verify(frame.sender, frame.signer_key, frame.signed, frame.signature, role=role_of_name(frame.sender))
    if trust.role(frame.sender) != "operator":
        raise ProtocolError(f"it is signed by {frame.sender!r}, which the trust file pins as "
                            f"{trust.role(frame.sender)!r}, not as an operator")
    message: JobSubmit = from_frame(frame)  # type: ignore[assignment]
    return frame.sender, job_from_dict(message.job, where=f"the job {frame.sender!r} signed"), message


def check_signed_job(data: bytes, trust: Trust, *, fleet: str, where: str) -> tuple[str, Job]:
    """:func:`open_signed_job` for a file (``where``): ConfigError in one sentence naming it."""
    try:
        return open_signed_job(data, trust, fleet=fleet)
    except (ProtocolError, ConfigError) as exc:
        raise ConfigError(f"Signed job {where} is not allowed: {str(exc).rstrip('.')}.") from None


def normalised(config: dict[str, Any]) -> dict[str, Any]:
    """A job's JSON as the coordinator runs it (``Job(...).model_dump(mode="json")``)."""
    return job_from_dict(config).model_dump(mode="json")


def job_refusal(run_id: str, config: dict[str, Any], submission: bytes, trust: Trust, *, fleet: str,
                required: bool, initial: np.ndarray | None = None) -> str | None:
    """Why run ``run_id`` of ``config`` (initial model ``initial``) forwarded with
    ``submission`` is refused (one sentence naming the job and the reason), or None: served.
    The key server and every agent ask it of every ``fleet/config``, whatever its run id.
    A submission must be an operator's signature of this very job: the same configuration,
    the run id it signed (its nonce: the coordinator cannot choose or re-use another) and the
    initial model it signed (its digest; a job signed where its model could not be built
    carries none, and the agents rebuild the model from the signed seed instead). Without a submission the run is served only when
    ``required`` is False (development mode, ``--allow-unsigned-jobs`` or no trust file); a
    submission, when given, is always checked."""
    if not submission:
        if not required:
            return None
        return (f"Job {run_id} is refused: it carries no job signed by an operator of fleet {fleet!r}, so the "
                "coordinator alone may have made it; submit it with `senseshield job submit` or give "
                f"`coordinator serve --job` a file of `senseshield job sign` (or start the key server and the "
                f"agents with {ALLOW_UNSIGNED}, or {DEV_FLAG} / {DEVELOPMENT_ENV}=1 on a development machine).")
    try:
        operator, job, signed_msg = open_submission(submission, trust, fleet=fleet)
        ran = normalised(config)
    except (ProtocolError, ConfigError) as exc:
        return (f"Job {run_id} is refused: the job it carries is not signed by an operator of fleet {fleet!r} "
                f"({str(exc).rstrip('.')}).")
    signed = job.model_dump(mode="json")
    differ = [k for k in sorted(set(signed) | set(ran)) if signed.get(k) != ran.get(k)]
    if differ:
        k = differ[0]
        return (f"Job {run_id} is refused: its configuration is not the job {operator!r} signed ({k} is "
                f"{_short(ran.get(k))}, signed {_short(signed.get(k))}).")
    if not signed_msg.nonce and required:
        return (f"Job {run_id} is refused: the job {operator!r} signed carries no nonce (signed by an older "
                "`senseshield job sign`); sign it again.")
    if signed_msg.nonce and run_id != signed_msg.nonce:
        return (f"Job {run_id} is refused: {operator!r} signed this job as run {signed_msg.nonce}; a coordinator "
                "cannot run a signed job under another id.")
    if initial is not None and signed_msg.initial_digest and model_digest(initial) != signed_msg.initial_digest:
        return (f"Job {run_id} is refused: its initial model (SHA-256 {model_digest(initial)[:16]}...) is not the one "
                f"{operator!r} signed ({signed_msg.initial_digest[:16]}...).")
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
