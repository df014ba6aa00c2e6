/* radixkv.service.wire._sigbus: a SIGBUS handler that survives a shrunk pool file.
 *
 * A pool file truncated under a running process (same uid, careless operator) turns every
 * later access past the new end into SIGBUS, which kills the process. The handler restores
 * the size of each watched file that is shorter than it must be (ftruncate: async-signal-safe,
 * no allocation: the pages read as zeros) and returns, so the faulting access is retried and
 * succeeds; it counts the repair, which Python reads with repaired() to stop cleanly. A SIGBUS
 * with no shrunk watched file is not ours: the previous action is put back and the fault
 * repeats under it (the default: the process dies, as before).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_WATCHED 64

static int watched_fd[MAX_WATCHED];
static off_t watched_size[MAX_WATCHED];
static volatile sig_atomic_t n_watched = 0;
static volatile sig_atomic_t n_repaired = 0;
static struct sigaction previous;
static int installed = 0;

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    int fixed = 0;
    (void)sig; (void)info; (void)ctx;
    for (int i = 0; i < n_watched; i++) {
        struct stat st;
        if (watched_fd[i] >= 0 && fstat(watched_fd[i], &st) == 0 && st.st_size < watched_size[i]
                && ftruncate(watched_fd[i], watched_size[i]) == 0)
            fixed = 1;
    }
    if (fixed) {
        n_repaired++;
        return;
    }
    sigaction(SIGBUS, &previous, NULL);
    installed = 0;
}

static PyObject *watch(PyObject *self, PyObject *args) {
    int fd;
    long long size;
    (void)self;
    if (!PyArg_ParseTuple(args, "iL", &fd, &size))
        return NULL;
    if (fd < 0 || size < 1) {
        PyErr_SetString(PyExc_ValueError, "watch(fd, nbytes) needs fd >= 0 and nbytes >= 1");
        return NULL;
    }
    for (int i = 0; i < n_watched; i++) {
        if (watched_fd[i] < 0) {
            watched_size[i] = (off_t)size;
            watched_fd[i] = fd;
            goto install;
        }
    }
    if (n_watched >= MAX_WATCHED) {
        PyErr_SetString(PyExc_OverflowError, "at most 64 pool files are watched");
        return NULL;
    }
    watched_fd[n_watched] = fd;
    watched_size[n_watched] = (off_t)size;
    n_watched++;
install:
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &previous) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *unwatch(PyObject *self, PyObject *args) {
    int fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    for (int i = 0; i < n_watched; i++)
        if (watched_fd[i] == fd)
            watched_fd[i] = -1;
    Py_RETURN_NONE;
}

static PyObject *repaired(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong((long)n_repaired);
}

static PyMethodDef methods[] = {
    {"watch", watch, METH_VARARGS, "watch(fd, nbytes): restore this file's size on SIGBUS."},
    {"unwatch", unwatch, METH_VARARGS, "unwatch(fd): stop watching fd (before closing it)."},
    {"repaired", repaired, METH_NOARGS, "How many SIGBUS faults a size repair has answered."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sigbus", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sigbus(void) { return PyModule_Create(&module); }
