/* The Python module shell of ckpttool's native kernels.
 *
 * The kernels themselves are plain C functions in the other files of this directory, exported
 * from this shared object and called through ctypes (ckpttool/engine/native.py), which releases
 * the GIL for the duration of each call. The module has no Python-level methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native", "ckpttool's native kernels (called through ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
