"""The checks every call of the syncer's gRPC server passes first, and how a refused call ends.

`CallChecks` authenticates a call: the run token (metadata `ddiloco-token`, compared in constant time) or a
learner's own token (`auth.learner_of_token`), and the schema version (metadata `ddiloco-schema-version`); a wrong
token ends the call with UNAUTHENTICATED, a wrong schema with FAILED_PRECONDITION. A call acting for a learner must
carry that learner's own token. Every refusal is recorded with the handler (`SyncerHandler.record_rejection`), also
when the call is cancelled meanwhile, and ends the call with its status and the reason in the trailing metadata key
`ddiloco-reason`. Bytes that are not a protobuf message at all reach a call as `Undecodable` and are refused as
malformed, after the token check. The calls themselves are `syncer_servicer`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from concurrent import futures
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from ddiloco.messages import SCHEMA_VERSION, RejectReason
from ddiloco.transport import wire_pb2
from ddiloco.transport.auth import learner_of_token
from ddiloco.transport.grpc_codec import MAX_LEARNER_ID, WireError
from ddiloco.transport.grpc_common import REASON_KEY, SCHEMA_KEY, TOKEN_KEY
from ddiloco.transport.syncer_handler import SyncerHandler

OPERATOR = -1
"""The identity of a call carrying the run token (status, evaluators): the operator's, no learner's."""


def _update_fields(header: wire_pb2.UpdateHeader | None) -> dict[str, int | None]:
    """fragment and inner_step of a checked update header, for a rejection record."""
    if header is None:
        return {"fragment": None, "inner_step": None}
    return {"fragment": int(header.fragment), "inner_step": int(header.inner_step)}


class CallChecks:
    """Authentication and refusal, for `SyncerServicer`, which sets `handler`, `_token` (the run token's bytes, or
    None: anyone may call) and `_pool` (where the handler's calls run)."""

    handler: SyncerHandler
    _token: bytes | None
    _pool: futures.ThreadPoolExecutor

    # ---- checks every call passes ----------------------------------------------------------------

    async def _refuse(self, context: grpc.aio.ServicerContext, error: WireError, learner_id: int | None,
                      header: wire_pb2.UpdateHeader | None = None) -> NoReturn:
        recorded = self._pool.submit(self.handler.record_rejection, error.reason, error.detail, learner_id=learner_id,
                                     peer=context.peer(), **_update_fields(header))
        # Shielded: a call cancelled while its record waits for a thread (its client died) is counted all the same.
        await asyncio.shield(asyncio.wrap_future(recorded))
        context.set_trailing_metadata(((REASON_KEY, error.reason),))
        await context.abort(error.status, f"{error.reason}: {error.detail}")
        raise AssertionError("abort returns only by raising")  # pragma: no cover

    async def _check_call(self, context: grpc.aio.ServicerContext) -> int | None:
        """Token and schema; who the caller is: OPERATOR (the run token), a learner id (its own token), or None
        when the server has no token (anyone)."""
        metadata = dict(context.invocation_metadata() or ())
        identity = None
        if self._token is not None:
            presented = str(metadata.get(TOKEN_KEY, ""))
            if hmac.compare_digest(presented.encode(), self._token):
                identity = OPERATOR
            else:
                identity = learner_of_token(self._token.decode(), presented)
            if identity is None:
                why = "no run token presented" if not presented else "wrong run token"
                await self._refuse(context, WireError(
                    "unauthenticated", f"{why}: start the learner with the syncer's --token-file or --token-env",
                    grpc.StatusCode.UNAUTHENTICATED), None)
        schema = metadata.get(SCHEMA_KEY)
        if schema != str(SCHEMA_VERSION):
            await self._refuse(context, WireError(
                "bad_schema", f"wire schema version {schema or 'missing'}, but the syncer speaks {SCHEMA_VERSION}: "
                "run the same ddiloco version everywhere (`ddiloco --version` shows each one's schema)",
                grpc.StatusCode.FAILED_PRECONDITION), None)
        return identity

    @staticmethod
    def _identity_error(identity: int | None, learner_id: int) -> WireError | None:
        """Why a call acting for `learner_id` is refused: it must carry that learner's own token (when the server
        has a token); None when it does."""
        if identity is None or identity == learner_id:
            return None
        if identity == OPERATOR:
            why = (f"a call for learner {learner_id} carries the run token, which proves no learner: a learner "
                   "presents its own token (ddiloco derives it from the run token; `ddiloco token --learner N`)")
        else:
            why = f"a call for learner {learner_id} carries learner {identity}'s token: a learner acts only as itself"
        return WireError("unauthenticated", why, grpc.StatusCode.UNAUTHENTICATED)

    async def _check_identity(self, context: grpc.aio.ServicerContext, identity: int | None, learner_id: int) -> None:
        error = self._identity_error(identity, learner_id)
        if error is not None:
            await self._refuse(context, error, learner_id)

    async def _check_learner_call(self, context: grpc.aio.ServicerContext, learner_id: int) -> int:
        """A learner's own small call (heartbeat, leave): token, schema, a valid id, that learner's token; the id."""
        identity = await self._check_call(context)
        try:
            self._check_learner_id(learner_id)
        except WireError as exc:
            await self._refuse(context, exc, None)
        await self._check_identity(context, identity, int(learner_id))
        return int(learner_id)

    @staticmethod
    def _check_learner_id(learner_id: int) -> None:
        if not 0 <= learner_id <= MAX_LEARNER_ID:
            raise WireError(str(RejectReason.UNKNOWN_LEARNER), f"learner_id={learner_id} is invalid")

    def _record_cancelled(self, context: grpc.aio.ServicerContext, what: str, learner_id: int | None,
                          header: wire_pb2.UpdateHeader | None = None) -> None:
        """An upload whose client cancelled it (or died) mid-stream: nothing reached the syncer. Recorded without
        waiting, the call being cancelled."""
        with contextlib.suppress(RuntimeError):  # the pool is gone: the server has stopped
            self._pool.submit(self.handler.record_rejection, "truncated", f"the client cancelled the {what} stream",
                              learner_id=learner_id, peer=context.peer(), **_update_fields(header))

    async def refuse_undecodable(self, context: grpc.aio.ServicerContext, request: Undecodable) -> NoReturn:
        await self._check_call(context)  # without the token it is unauthenticated, whatever its bytes are
        await self._refuse(context, request.error, None)


class Undecodable:
    """A request whose bytes are not its protobuf message (bad UTF-8 in a string field, a cut field). gRPC's own
    deserializer would end the call UNKNOWN with a traceback in the log, before any token is checked and with
    nothing recorded; instead the call passes the usual checks and is refused as malformed."""

    def __init__(self, error: DecodeError) -> None:
        self.error = WireError("malformed", f"the request is not a valid protobuf message: {error}")
