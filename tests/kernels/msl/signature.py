"""The kernel function's signature, written the way MLX writes it.

``SignatureMixin`` (a base of ``HarnessKernel``) produces the Metal source
MLX would generate (``metal_source``) and the C++ the harness compiles
(``_cpp_source``): same parameters, same rules for which shape, stride and
thread-position parameters appear, same kernel names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .common import (
    _ATTRIBUTE_FIELD,
    MAX_CONSTANT_ARRAY_SIZE,
    _type_string,
)
from .translate import FILE_HEADER, FILE_SOURCE, _Translator


@dataclass
class _Param:
    kind: str  # "buffer", "scalar", "shape", "strides", "ndim", "output"
    name: str
    ctype: str  # element type in C++
    msl: str  # the MSL declaration (for verbose output)


def _to_array(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


class SignatureMixin:
    """Signature and source generation; needs ``name``, ``input_names``,
    ``output_names``, ``source``, ``header``, ``shape_infos``, ``attributes``
    and ``atomic_outputs`` on the instance."""

    def _params(self, inputs: list[mx.array], output_dtypes) -> list[_Param]:
        params = []
        for name, arr, (want_shape, want_strides, want_ndim) in zip(
            self.input_names, inputs, self.shape_infos
        ):
            t = _type_string(arr.dtype)
            space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
            if arr.ndim == 0:
                params.append(_Param("scalar", name, t, f"const {space} {t}& {name}"))
                continue
            params.append(_Param("buffer", name, t, f"const {space} {t}* {name}"))
            if want_shape:
                params.append(
                    _Param(
                        "shape",
                        f"{name}_shape",
                        "int",
                        f"const constant int* {name}_shape",
                    )
                )
            if want_strides:
                params.append(
                    _Param(
                        "strides",
                        f"{name}_strides",
                        "int64_t",
                        f"const constant int64_t* {name}_strides",
                    )
                )
            if want_ndim:
                params.append(
                    _Param(
                        "ndim",
                        f"{name}_ndim",
                        "int",
                        f"const constant int& {name}_ndim",
                    )
                )
        for name, dtype in zip(self.output_names, output_dtypes):
            t = _type_string(dtype)
            if self.atomic_outputs:
                params.append(
                    _Param(
                        "output",
                        name,
                        f"metal::atomic<{t}>",
                        f"device atomic<{t}>* {name}",
                    )
                )
            else:
                params.append(_Param("output", name, t, f"device {t}* {name}"))
        return params

    def _kernel_name(self, inputs, output_dtypes, template) -> str:
        kname = f"custom_kernel_{self.name}"
        if template:
            tdef = "<" + ", ".join(v for _, _, v in template) + ">"
            h = re.sub(r"<|>|, ", "_", tdef)[:-1]
            kname += "_" + h
        for a in inputs:
            kname += "_" + _type_string(a.dtype)
            if a.ndim == 0:
                kname += "s"
            elif a.size < MAX_CONSTANT_ARRAY_SIZE:
                kname += "c"
        for d in output_dtypes:
            kname += "_" + _type_string(d)
        return kname

    @staticmethod
    def _template_args(template) -> list[tuple[str, str, str]]:
        """(name, MSL parameter kind, value text) for each template arg."""
        out = []
        for name, value in template or []:
            if isinstance(value, mx.Dtype):
                out.append((name, "typename", _type_string(value)))
            elif isinstance(value, (bool, np.bool_)):
                # MLX streams bools as 1/0 into the kernel name and source
                out.append((name, "bool", "1" if value else "0"))
            elif isinstance(value, (int, np.integer)):
                out.append((name, "int", str(int(value))))
            else:
                raise TypeError(
                    f"[metal_kernel] template argument {name!r} must be a Dtype, int or bool"
                )
        return out

    def metal_source(self, inputs, output_dtypes, template=None) -> str:
        """The Metal source MLX would generate for these arguments."""
        inputs = [_to_array(x) for x in inputs]
        targs = self._template_args(template)
        params = self._params(inputs, output_dtypes)
        kname = self._kernel_name(inputs, output_dtypes, targs)
        src = self.header
        if targs:
            src += "template <" + ", ".join(f"{k} {n}" for n, k, _ in targs) + ">\n"
        lines = [f"  {p.msl} [[buffer({i})]]" for i, p in enumerate(params)]
        lines += [f"  {t} {a} [[{a}]]" for a, t in self.attributes]
        src += f"[[kernel]] void {kname}(\n" + ",\n".join(lines) + ") {\n"
        src += self.source + "\n}\n"
        if targs:
            inst = kname + "<" + ", ".join(v for _, _, v in targs) + ">"
            src += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
        return src

    def _cpp_source(self, params, targs, debug) -> tuple[str, _Translator]:
        tr = _Translator(self.name)
        header = tr.translate(self.header, FILE_HEADER)
        body = tr.translate(self.source, FILE_SOURCE)

        def ptype(p: _Param) -> str:
            if p.kind == "scalar":
                return f"const {p.ctype}&"
            if p.kind == "ndim":
                return "const int&"
            elem = p.ctype if p.kind == "output" else f"const {p.ctype}"
            return f"::msl::dptr<{elem}>" if debug else f"{elem}*"

        sig = [f"  {ptype(p)} {p.name}" for p in params]
        sig += [
            f"  {'metal::uint3' if t == 'uint3' else 'uint'} {a}"
            for a, t in self.attributes
        ]
        call = []
        for i, p in enumerate(params):
            if p.kind in ("scalar", "ndim"):
                ct = "int" if p.kind == "ndim" else p.ctype
                call.append(f"*static_cast<const {ct}*>(__d->args[{i}])")
                continue
            elem = p.ctype if p.kind == "output" else f"const {p.ctype}"
            raw = f"static_cast<{elem}*>(__d->args[{i}])"
            if debug:
                call.append(
                    f'::msl::dptr<{elem}>({raw}, __d->lo[{i}], __d->hi[{i}], "{p.name}")'
                )
            else:
                call.append(raw)
        for a, t in self.attributes:
            field = _ATTRIBUTE_FIELD[a]
            call.append(
                f"::msl::u3(__ti->{field})" if t == "uint3" else f"__ti->{field}"
            )
        tmpl = ""
        inst = ""
        if targs:
            tmpl = "template <" + ", ".join(f"{k} {n}" for n, k, _ in targs) + ">\n"
            inst = "<" + ", ".join(v for _, _, v in targs) + ">"
        parts = [
            f"// kernel '{self.name}', generated by tests/kernels/msl/harness.py\n",
            '#include "msl_shim.h"\n',
            '#line 1 "msl-header"\n',
            header,
            "\n",
            '#line 1 "msl-signature"\n',
            tmpl,
            "void __msl_kernel(\n" + ",\n".join(sig) + ") {\n",
            '#line 1 "msl-source"\n',
            body,
            "\n}\n",
            '#line 1 "msl-launch"\n',
            'extern "C" void msl_thread(const msl_launch_desc* __d, '
            "const msl_thread_info* __ti) {\n",
            f"  (void)__ti;\n  __msl_kernel{inst}(\n    "
            + ",\n    ".join(call)
            + ");\n}\n",
        ]
        return "".join(parts), tr
