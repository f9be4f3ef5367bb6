"""PPO checkpoints: everything a killed run needs to resume as if it never stopped (trainable weights, the optimiser,
every random stream, the KL controller, the score statistics, the prompt queue and the history), written atomically
and durably, and read back (the newest readable of the last two); and the final policy with its value model
(`save`). A mixin of rlhflow.ppo.trainer.PPOTrainer, whose attributes it reads and restores."""

from __future__ import annotations

import copy
import json
import os
import uuid
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlhflow.config.params import REPO_ROOT
from rlhflow.fsutil import ForeignPathError, fsync_dir, fsync_tree, is_made, mark_made, remove_made
from rlhflow.models.loading import is_peft, save_plain
from rlhflow.models.policy import Critic
from rlhflow.training import distributed

CHECKPOINT_PREFIX = "step-"
KEPT_CHECKPOINTS = 2  # the newest and the one before it, to fall back to
# PPO settings that may change between a run and its resumption without changing what the run means: the run
# length, where checkpoints go, and the memory knobs (how a minibatch's gradient is computed, not what it is: a run
# that ran out of memory resumes with them set). tasks/ppo.py keys a checkpoint dir on the others.
RESUMABLE_SETTINGS = {
    "steps",
    "checkpoint_every",
    "checkpoint_dir",
    "out_dir",
    "gradient_checkpointing",
    "micro_batch_size",
}


def repo_path(path: str | os.PathLike) -> Path:
    """Relative paths are relative to the repository root, as everywhere in params.yaml."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else REPO_ROOT / p


class Checkpoints:
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().contiguous().cpu() for name, p in self.model.named_parameters() if p.requires_grad}

    def save_checkpoint(self) -> Path:
        """Write checkpoint_dir/step-NNNNNN atomically and durably (a marked temp dir, flushed to disk, renamed into
        place); all but the newest KEPT_CHECKPOINTS are removed, so a newest one found cut short or unreadable on
        resumption still has an older one to fall back to."""
        root = self.checkpoint_dir
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"{CHECKPOINT_PREFIX}{self.step:06d}"
        tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        mark_made(tmp, "ppo.checkpoint_dir")
        try:
            self._write_state(tmp)
            fsync_tree(tmp)
            if final.exists() and not remove_made(final):
                raise ForeignPathError(
                    f"ppo.checkpoint_dir: {final} is a directory the pipeline did not make; left as it was"
                )
        except BaseException:
            remove_made(tmp)
            raise
        os.replace(tmp, final)
        fsync_dir(root)
        for old in self._checkpoints(root)[:-KEPT_CHECKPOINTS]:
            remove_made(old)
        return final

    def _write_state(self, directory: Path) -> None:
        save_file(self._trainable_state(), str(directory / "trainable.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        rng = {"torch": torch.get_rng_state(), "generator": self.generator.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, directory / "rng.pt")
        py_state = self.py_rng.getstate()
        state = {
            "step": self.step,
            "kl_controller": self.kl_ctl.state_dict(),
            "running_scores": self.running_scores.state_dict(),
            "sft_scores": self.sft_scores.state_dict(),
            "prompt_queue": self._prompt_queue,
            "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
            "history": self.history,
            "config": self.cfg.model_dump(),
        }
        (directory / "trainer_state.json").write_text(json.dumps(state))

    @staticmethod
    def _checkpoints(root: Path) -> list[Path]:
        """The complete checkpoints in `root` the pipeline made, oldest first."""
        if not root.is_dir():
            return []
        return sorted(
            p
            for p in root.iterdir()
            if p.is_dir()
            and p.name.startswith(CHECKPOINT_PREFIX)
            and (p / "trainer_state.json").exists()
            and is_made(p)
        )

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> bool:
        """Restore everything from `path` or the latest checkpoint in cfg.checkpoint_dir; False when none exists.

        With several processes the main process alone reads the checkpoint and sends it to the others (weights by
        broadcast, the rest as one pickled object), so ranks on machines that do not share the checkpoint
        directory resume from the main process's state, never from their own."""

        state = self._read_checkpoint(path) if distributed.is_main_process() else None
        if distributed.world_size() > 1:  # all but the weights, which follow as tensors
            rest = None if state is None else {k: v for k, v in state.items() if k != "trainable"}
            rest = distributed.broadcast_object(rest)
            state = state if distributed.is_main_process() else rest
        if state is None:
            return False
        if "trainable" in state:  # read here: the main process, or a single one
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in state["trainable"].items():
                    params[name].copy_(tensor)
        distributed.broadcast_parameters(self.model)  # every process from the main process's weights
        self.optimizer.load_state_dict(state["optimizer"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        self.generator.set_state(rng["generator"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        version, internal, gauss = state["python_rng"]
        self.py_rng.setstate((version, tuple(internal), gauss))
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.running_scores.load_state_dict(state["running_scores"])
        if "sft_scores" in state:  # checkpoints from before reward_normalization=sft have none
            self.sft_scores.load_state_dict(state["sft_scores"])
        self._prompt_queue = list(state["prompt_queue"])
        self.history = state["history"]
        self.step = int(state["step"])
        return True

    def _read_checkpoint(self, path: str | os.PathLike | None) -> dict | None:
        """The checkpoint at `path` (default: the newest readable one in cfg.checkpoint_dir) in memory, or None when
        there is none. An unreadable newest checkpoint (cut short by a crash, a full disk) is named in a warning and
        the one before it is read instead."""
        if path is not None:
            return self._read_checkpoint_at(Path(path))
        found = self._checkpoints(self.checkpoint_dir)
        for candidate in reversed(found):
            try:
                return self._read_checkpoint_at(candidate)
            except Exception as err:  # any damage: a cut file, bad JSON, a broken zip or safetensors header
                warnings.warn(
                    f"PPO checkpoint {candidate} is unreadable ({type(err).__name__}: {err}); trying an older one",
                    stacklevel=2,
                )
        if found:
            raise RuntimeError(
                f"no PPO checkpoint in {self.checkpoint_dir} is readable ({', '.join(p.name for p in found)}); delete "
                "the directory to train from the start"
            )
        return None

    def _read_checkpoint_at(self, path: Path) -> dict:
        state = json.loads((path / "trainer_state.json").read_text())
        # a linear learning-rate schedule spans `steps`: another run length changes the updates already made
        resumable = RESUMABLE_SETTINGS - ({"steps"} if self.cfg.lr_schedule == "linear" else set())
        changed = sorted(
            k for k, v in self.cfg.model_dump().items() if k not in resumable and state["config"].get(k) != v
        )
        state["trainable"] = load_file(str(path / "trainable.safetensors"))
        # on the CPU: load_state_dict moves each state tensor to its parameter's device (also on the other ranks)
        state["optimizer"] = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        state["rng"] = torch.load(path / "rng.pt", weights_only=True)
        if changed:  # once the checkpoint has been read whole: a damaged one is skipped without this warning
            warnings.warn(f"resuming from {path} with changed PPO settings: {', '.join(changed)}", stacklevel=3)
        return state

    # ---- saving ------------------------------------------------------------------------------------

    def _value_state(self) -> dict[str, torch.Tensor]:
        module = self.model.value_module()
        if isinstance(module, Critic) and is_peft(module.backbone):
            module = copy.deepcopy(module)
            module.backbone = module.backbone.merge_and_unload()
        return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}

    def save(self, out_dir: str | os.PathLike | None = None) -> Path:
        """The policy as a plain model dir (LoRA merged) in out_dir (default cfg.out_dir), plus
        `value_head.safetensors` (the value head, or with value_model=separate the whole critic: backbone.*, head.*)."""
        out = repo_path(out_dir if out_dir is not None else self.cfg.out_dir)
        policy = self.policy
        if is_peft(policy):
            policy = copy.deepcopy(policy).merge_and_unload()
        save_plain(policy, self.tokenizer, out)
        save_file(
            self._value_state(), str(out / "value_head.safetensors"), metadata={"value_model": self.cfg.value_model}
        )
        return out
