"""Structured output at the HTTP edge: the request's constraint (`response_format`, vLLM's
`guided_*` / `structured_outputs`, or a tool call's schema), checked off the event loop, into the
request's SamplingParams. The engine compiles and enforces it (docs/structured-output.md)."""
from __future__ import annotations

import asyncio
import dataclasses

from specserve.scheduler.validation import check_constraint, with_unnamed_properties
from specserve.server.errors import bad_request
from specserve.server.protocol import SamplingFields
from specserve.spec_phases.sampling_params import Constraint, ParamError, SamplingParams


def request_constraint(body: SamplingFields, unnamed_properties: bool = False
                       ) -> Constraint | None:
    """The body's constraint fields -> one Constraint, or a 400 naming the field.
    unnamed_properties: a JSON schema's objects that say nothing of `additionalProperties` admit
    other properties (JSON Schema's reading) instead of none (vLLM's default grammar's)."""
    try:
        constraint = body.constraint()
    except ParamError as exc:
        raise bad_request(exc.message, exc.param) from None
    if unnamed_properties and constraint is not None:
        constraint = with_unnamed_properties(constraint)
    return constraint


async def checked(constraint: Constraint | None) -> Constraint | None:
    """A 400 naming the field if the grammar library cannot compile the constraint; the check
    runs on a worker thread, so a large schema never stalls other requests' streams."""
    if constraint is not None:
        try:
            await asyncio.to_thread(check_constraint, constraint)
        except ParamError as exc:
            raise bad_request(exc.message, exc.param) from None
    return constraint


def constrained(params: SamplingParams, constraint: Constraint | None) -> SamplingParams:
    return params if constraint is None else dataclasses.replace(params, constraint=constraint)
