"""The hub tests' fixtures (test_hub.py, test_hub_mtp_from.py): the repos
the fake hub publishes (written once), a hub serving them, and the
environment of a client of it with an empty cache."""

import pytest

from mlx_spec.testing.hub_release import client_env, publish_repos, serving_repos


@pytest.fixture(scope="session")
def repos(tmp_path_factory, save_mlx_dir):
    """Directories published on the fake hub: the raw release, its MLX
    conversion and a sidecar-only repo (written by ``convert --hf-path``);
    tests copy them before changing anything."""
    return publish_repos(tmp_path_factory.mktemp("hub_repos"), save_mlx_dir)


@pytest.fixture
def hub(repos):
    with serving_repos(repos) as hub:
        yield hub


@pytest.fixture
def env(hub, tmp_path):
    """The environment of a client of ``hub`` with an empty cache."""
    return client_env(hub, tmp_path / "hf_home")
