"""`GET /v1/models/{id}` (`client.models.retrieve`): one entry of the list, same tenancy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest
from openai_spec import validate

if TYPE_CHECKING:
    from conftest import GatewayFactory


def test_retrieve_follows_the_keys_view_of_the_list(start_gateway: GatewayFactory) -> None:
    gateway = start_gateway(
        admin_api_key="sk-admin",
        agents=[
            {"name": "support", "api_keys": ["sk-support"]},
            {"name": "sales", "api_keys": ["sk-sales"]},
        ],
    )
    admin = gateway.openai(api_key="sk-admin")
    for listed in admin.models.list().data:
        one = admin.models.retrieve(listed.id)
        assert one.model_dump() == listed.model_dump()
    support = gateway.openai(api_key="sk-support")
    assert support.models.retrieve("support").id == "support"
    with gateway.http() as http:
        body = http.get("/v1/models/support", headers={"Authorization": "Bearer sk-support"})
        assert body.status_code == 200
        validate("Model", body.json())
    # Another tenant's agent, the bare base model (admins only) and an unknown name all
    # answer the same 404, so a key cannot learn which other agents exist.
    for hidden in ("sales", "tiny-base", "nobody"):
        with pytest.raises(openai.NotFoundError) as info:
            support.models.retrieve(hidden)
        assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        gateway.openai(api_key="sk-wrong").models.retrieve("support")
