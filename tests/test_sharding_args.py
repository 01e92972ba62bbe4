"""Argument checks of `jaxgdn.sharding` (make_mesh, shard_model, init_state, plan): a bad argument raises a one-line
`jaxgdn.InputError`, never an AttributeError / TypeError / JAX runtime error.

Runs in the ordinary pytest process (however many devices it sees, usually one): where a mesh is needed it is
`make_mesh(1)`, duplicate devices are `[jax.devices()[0]] * 2`, and too large sizes are above `len(jax.devices())`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxgdn
from jaxgdn import sharding as S
from jaxgdn.errors import InputError

FIXTURE = Path(__file__).absolute().parent / "fixtures" / "qwen3_5_tiny"


@pytest.fixture(scope="module")
def tiny():
    return jaxgdn.tiny_model("tiny")


@pytest.fixture(scope="module")
def mesh1():
    return S.make_mesh(1)


# ---- make_mesh ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [0, -1, 2.0, True, False, np.bool_(True), "2"])
def test_make_mesh_refuses_a_size_that_is_not_an_integer_at_least_1(tp):
    with pytest.raises(InputError, match="integer >= 1"):
        S.make_mesh(tp)


def test_make_mesh_refuses_more_devices_than_available():
    n = len(jax.devices())
    with pytest.raises(InputError, match=f"{n + 1} devices.*{n} available"):
        S.make_mesh(n + 1)


def test_make_mesh_refuses_duplicate_devices():
    d0 = jax.devices()[0]
    with pytest.raises(InputError, match="more than once"):
        S.make_mesh(2, devices=[d0, d0])
    with pytest.raises(InputError, match="more than once"):
        S.make_mesh(devices=[d0, d0])


def test_make_mesh_refuses_a_device_list_of_another_length():
    d0 = jax.devices()[0]
    with pytest.raises(InputError, match="2 devices was asked for but 1"):
        S.make_mesh(2, devices=[d0])


@pytest.mark.parametrize("devices", [[], "cpu", [0], 3])
def test_make_mesh_refuses_bad_device_lists(devices):
    with pytest.raises(InputError, match="make_mesh: devices"):
        S.make_mesh(devices=devices)


def test_make_mesh_accepts_valid_sizes():
    d0 = jax.devices()[0]
    for mesh in (S.make_mesh(1), S.make_mesh(np.int64(1)), S.make_mesh(1, devices=[d0]), S.make_mesh(devices=[d0])):
        assert mesh.axis_names == (S.TP,) and mesh.shape[S.TP] == 1
        assert mesh.axis_types == (AxisType.Auto,)
        assert list(mesh.devices.flat) == [d0]
    assert S.make_mesh().shape[S.TP] == len(jax.devices())


# ---- shard_model / load_pretrained / plan: the mesh argument -----------------------------------------------------

@pytest.mark.parametrize("mesh", ["tp", 2, 1.0, [0]])
def test_shard_model_needs_a_mesh(tiny, mesh):
    with pytest.raises(InputError, match=r"jax\.sharding\.Mesh.*make_mesh"):
        S.shard_model(tiny, mesh)


def test_shard_model_needs_a_tp_axis(tiny):
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    with pytest.raises(InputError, match=r"no 'tp' axis \(its axes: \('x',\)\)"):
        S.shard_model(tiny, mesh)
    with pytest.raises(InputError, match="no 'tp' axis"):
        S.plan(tiny.config, mesh)


def test_shard_model_needs_a_model(mesh1):
    with pytest.raises(InputError, match="must be a jaxgdn Model"):
        S.shard_model("model", mesh1)


@pytest.mark.parametrize("mesh", ["tp", 2])
def test_load_pretrained_with_a_bad_mesh(mesh, tmp_path):
    with pytest.raises(InputError, match=r"jax\.sharding\.Mesh"):
        jaxgdn.load_pretrained(FIXTURE, mesh=mesh)
    with pytest.raises(InputError, match=r"jax\.sharding\.Mesh"):  # checked before any file is opened
        jaxgdn.load_pretrained(tmp_path / "no such checkpoint", mesh=mesh)


@pytest.mark.parametrize("tp", [0, -2, "2", 2.0, True])
def test_plan_refuses_bad_sizes(tiny, tp):
    with pytest.raises(InputError):
        S.plan(tiny.config, tp)


def test_plan_takes_an_integer_size_or_a_mesh(tiny, mesh1):
    assert S.plan(tiny.config, 2) == S.plan(tiny.config, np.int32(2))
    assert S.plan(tiny.config, mesh1).tp == 1


# ---- init_state: batch size and capacity -------------------------------------------------------------------------

def test_sharded_init_state_takes_integer_scalars(tiny, mesh1):
    sm = S.shard_model(tiny, mesh1)
    assert S.mesh_of(sm) is mesh1
    state = sm.init_state(jnp.int32(2), 64)  # hashable sizes for the compiled zeros' cache
    again = sm.init_state(2, np.int64(64))
    assert state.position.shape == (2,)
    assert jax.tree.structure(state) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
        assert a.shape == b.shape and a.sharding == b.sharding
    assert S._sharded_zeros.cache_info().currsize >= 1
    keys = S._sharded_zeros.cache_info()
    sm.init_state(np.int16(2), jnp.int32(64))  # the same (int) key: no new entry
    assert S._sharded_zeros.cache_info().currsize == keys.currsize


@pytest.mark.parametrize("batch_size, capacity", [(True, 64), (2, False), (2.0, 64), (2, 64.5), ("2", 64),
                                                  (0, 64), (2, 0), (-1, 64)])
def test_sharded_init_state_refuses_bad_sizes(tiny, mesh1, batch_size, capacity):
    sm = S.shard_model(tiny, mesh1)
    with pytest.raises(InputError, match="batch_size and capacity"):
        sm.init_state(batch_size, capacity)
    with pytest.raises(InputError, match="batch_size and capacity"):
        S.init_state(tiny, batch_size, capacity, mesh=mesh1)


def test_init_state_refuses_a_bad_mesh(tiny):
    with pytest.raises(InputError, match=r"init_state: mesh must be a jax\.sharding\.Mesh"):
        S.init_state(tiny, 2, 64, mesh="tp")
