/* kvguard._fastpath: the guard's fast-path wrappers in C (optional; see kvguard/guard/shadowing.py).
 *
 * A Release (free or share) or Allocate object does exactly what the closures ``release`` and
 * ``allocate`` of kvguard.guard.shadowing do on their fast path, with everything bound at
 * construction, and hands every other case to the same Python careful-path function with the
 * same arguments (through a Python trampoline that stands in for the closure's own frame, so the
 * careful path's site capture counts frames as it does under the closures). The closures stay
 * the reference: a differential test holds both implementations and the careful path to the
 * same verdicts, ledgers, counters and flight recorder.
 *
 * Ledger columns are array.array objects read and written through their item pointer, fetched
 * afresh at every access (a column may grow while the allocator runs; no buffer is ever held).
 * The module checks at import that the array layout it relies on is the one it finds, and
 * refuses to import otherwise: kvguard then uses the closures.
 *
 * Python 3.10-3.13, C API only, nothing imported but ``array``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef MS_WINDOWS
#include <windows.h>
#else
#include <time.h>
#endif

/* --- array.array layout (Modules/arraymodule.c, unchanged 3.10-3.13; checked at import) --- */

struct arraydescr_mirror {
    char typecode;
    int itemsize;
};

typedef struct {
    PyObject_VAR_HEAD
    char *ob_item;
    Py_ssize_t allocated;
    const struct arraydescr_mirror *ob_descr;
} array_mirror;

static PyTypeObject *array_type = NULL;

#define ARR(o) ((array_mirror *)(o))

/* The ledger holder column's mark for a block of several holders, whose books are in the
   sparse holders map (kvguard.holderbooks.SEVERAL); no holder number reaches it. */
#define SEVERAL 0xFFFFFFFFLL

static int
is_column(PyObject *o, char code)
{
    return Py_TYPE(o) == array_type && ARR(o)->ob_descr->typecode == code;
}

/* Element access with the array's own behaviour outside the common case: an index past the
   column's present length, or a value the C type cannot hold, goes through the sequence
   protocol, which raises what ``column[b] = v`` raises in Python. */

/* Outside the common case, ``col[b]`` read through the sequence protocol. */
static int
get_slow(PyObject *col, Py_ssize_t b, long long *out)
{
    PyObject *v = PySequence_GetItem(col, b);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int
get_q(PyObject *col, Py_ssize_t b, long long *out)
{
    if (b < Py_SIZE(col) && is_column(col, 'q')) {
        *out = ((int64_t *)ARR(col)->ob_item)[b];
        return 0;
    }
    return get_slow(col, b, out);
}

static int
get_i(PyObject *col, Py_ssize_t b, long long *out)
{
    if (b < Py_SIZE(col) && is_column(col, 'i')) {
        *out = ((int32_t *)ARR(col)->ob_item)[b];
        return 0;
    }
    return get_slow(col, b, out);
}

static int
get_u32(PyObject *col, Py_ssize_t b, long long *out)
{
    if (b < Py_SIZE(col) && is_column(col, 'I')) {
        *out = ((uint32_t *)ARR(col)->ob_item)[b];
        return 0;
    }
    return get_slow(col, b, out);
}

/* obj: the value as a Python object when ``valid`` is 0 (NULL: make it from v). */
static int
set_slow(PyObject *col, Py_ssize_t b, long long v, PyObject *obj)
{
    int rc;
    if (obj != NULL)
        return PySequence_SetItem(col, b, obj);
    obj = PyLong_FromLongLong(v);
    if (obj == NULL)
        return -1;
    rc = PySequence_SetItem(col, b, obj);
    Py_DECREF(obj);
    return rc;
}

static int
set_q(PyObject *col, Py_ssize_t b, long long v, int valid, PyObject *obj)
{
    if (valid && b < Py_SIZE(col) && is_column(col, 'q')) {
        ((int64_t *)ARR(col)->ob_item)[b] = v;
        return 0;
    }
    return set_slow(col, b, v, valid ? NULL : obj);
}

static int
set_u32(PyObject *col, Py_ssize_t b, long long v, int valid, PyObject *obj)
{
    if (valid && v >= 0 && v <= 0xFFFFFFFFLL && b < Py_SIZE(col) && is_column(col, 'I')) {
        ((uint32_t *)ARR(col)->ob_item)[b] = (uint32_t)v;
        return 0;
    }
    return set_slow(col, b, v, valid ? NULL : obj);
}

static int
set_i(PyObject *col, Py_ssize_t b, long long v, int valid, PyObject *obj)
{
    if (valid && v >= INT32_MIN && v <= INT32_MAX && b < Py_SIZE(col) && is_column(col, 'i')) {
        ((int32_t *)ARR(col)->ob_item)[b] = (int32_t)v;
        return 0;
    }
    return set_slow(col, b, v, valid ? NULL : obj);
}

/* A Python int as a long long; *valid 0 when it is not an exact int or does not fit. */
static long long
as_ll(PyObject *o, int *valid)
{
    int overflow = 0;
    long long v;
    if (!PyLong_CheckExact(o)) {
        *valid = 0;
        return 0;
    }
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *valid = 0;
        return overflow;
    }
    *valid = 1;
    return v;
}

/* --- interned names -------------------------------------------------------------------- */

static PyObject *s_free, *s_share, *s_allocate, *s_free_calls, *s_blocks_freed,
    *s_share_calls, *s_blocks_shared, *s_alloc_calls, *s_blocks_allocated;

static int
stats_add(PyObject *stats, PyObject *name, Py_ssize_t n)
{
    PyObject *old, *add, *new_;
    int rc;
    old = PyObject_GetAttr(stats, name);
    if (old == NULL)
        return -1;
    add = PyLong_FromSsize_t(n);
    if (add == NULL) {
        Py_DECREF(old);
        return -1;
    }
    new_ = PyNumber_InPlaceAdd(old, add);
    Py_DECREF(old);
    Py_DECREF(add);
    if (new_ == NULL)
        return -1;
    rc = PyObject_SetAttr(stats, name, new_);
    Py_DECREF(new_);
    return rc;
}

/* Where a Stats counter lives: ``offset`` into the stats object of one of Counters' C long
   longs (see below), or -1: go through getattr/setattr as Python does. Construction asks once
   (counter_place). */
typedef struct {
    Py_ssize_t offset;
} CounterPlace;

/* ``stats.<name> += n``: in place where construction found a Counters counter, else through
   getattr/setattr. A counter that would overflow goes through setattr too, which raises the
   OverflowError that ``stats.<name> += n`` raises in Python (and leaves it as it was). */
static int
stats_bump(PyObject *stats, CounterPlace place, PyObject *name, Py_ssize_t n)
{
    if (place.offset >= 0) {
        long long *c = (long long *)((char *)stats + place.offset);
        if ((n >= 0 && *c <= LLONG_MAX - n) || (n < 0 && *c >= LLONG_MIN - n)) {
            *c += n;
            return 0;
        }
    }
    return stats_add(stats, name, n);
}

/* Counters: the base of kvguard.guard.telemetry.Stats while this module is in use. Its eight
   counters are C long longs, so a wrapper's ``stats.<name> += n`` is one addition in place
   where a Python int counter costs a new int per bump (and freeing the old one). Python reads
   each as an int and sets it from any integer (``__index__``) through a getset of its own:
   a value outside a long long raises OverflowError and changes nothing (a T_LONGLONG member
   would store -1 first), deleting one raises TypeError. No other state: Stats adds
   ``violations``. */
typedef struct {
    PyObject_HEAD
    long long alloc_calls, free_calls, share_calls, blocks_allocated, blocks_freed,
        blocks_shared, learned, internal_errors;
} Counters;

static PyObject *
counter_get(PyObject *self, void *offset)
{
    return PyLong_FromLongLong(*(long long *)((char *)self + (size_t)offset));
}

static int
counter_set(PyObject *self, PyObject *value, void *offset)
{
    PyObject *i;
    long long v;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "a counter cannot be deleted");
        return -1;
    }
    i = PyNumber_Index(value);
    if (i == NULL)
        return -1;
    v = PyLong_AsLongLong(i);
    Py_DECREF(i);
    if (v == -1 && PyErr_Occurred())
        return -1;  /* OverflowError: the counter keeps its value */
    *(long long *)((char *)self + (size_t)offset) = v;
    return 0;
}

#define COUNTER(name) \
    {#name, counter_get, counter_set, NULL, (void *)offsetof(Counters, name)}

static PyGetSetDef counters_getset[] = {
    COUNTER(alloc_calls), COUNTER(free_calls), COUNTER(share_calls), COUNTER(blocks_allocated),
    COUNTER(blocks_freed), COUNTER(blocks_shared), COUNTER(learned), COUNTER(internal_errors),
    {NULL, NULL, NULL, NULL, NULL},
};

#define N_COUNTERS ((Py_ssize_t)(sizeof(counters_getset) / sizeof(counters_getset[0])) - 1)

static PyTypeObject Counters_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.Counters",
    .tp_basicsize = sizeof(Counters),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A guard's counters as C integers (the base of kvguard's Stats when compiled).",
    .tp_getset = counters_getset,
    .tp_new = PyType_GenericNew,
};

/* Where ``stats.<name>`` lives (see CounterPlace): one of Counters' own getsets, found as
   the class's descriptor for the name, with the generic attribute access (an instance cannot
   shadow a data descriptor then); anything else (a subclass's property, a plain object) is
   read and written by name. */
static CounterPlace
counter_place(PyObject *stats, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(stats);
    PyObject *descr;
    CounterPlace place = {-1};
    if (!PyObject_TypeCheck(stats, &Counters_Type) || tp->tp_getattro != PyObject_GenericGetAttr ||
        tp->tp_setattro != PyObject_GenericSetAttr)
        return place;
    descr = PyObject_GetAttr((PyObject *)tp, name);  /* the class's descriptor */
    if (descr == NULL) {
        PyErr_Clear();
        return place;
    }
    if (Py_IS_TYPE(descr, &PyGetSetDescr_Type)) {
        PyGetSetDef *g = ((PyGetSetDescrObject *)descr)->d_getset;
        if (g >= counters_getset && g < counters_getset + N_COUNTERS)
            place.offset = (Py_ssize_t)(size_t)g->closure;
    }
    Py_DECREF(descr);
    return place;
}

/* --- the flight recorder ------------------------------------------------------------------- */

/* FlightRecorder: a guard's ``history`` while this module is in use, in place of
   ``collections.deque(maxlen=history)``. It keeps the last ``maxlen`` entries ``(call, ids,
   site, pool, op)`` as five references per slot of a ring, so a wrapper records a call by
   storing five pointers, where the deque costs a tuple per call, a call of its bound append,
   and freeing the evicted tuple. Tuples are built only when the recorder is read: iteration
   (oldest first, over a snapshot), ``len``, ``r[i]`` (negative too), ``reversed``, ``in``,
   ``bool``; ``append`` takes a 5-tuple (what kvguard's Python side writes), ``clear()``,
   ``maxlen``, copy and pickle. Slots are allocated as entries arrive (doubling up to maxlen),
   so a huge ``history`` costs nothing until it fills. Every change leaves the ring whole
   before it drops a reference: a dropped entry's field may run code (a finalizer) that reads
   or appends to the recorder; readers re-read the ring after every allocation for the same
   reason (an allocation may run the garbage collector). */
#define FIELDS 5

typedef struct {
    PyObject_HEAD
    Py_ssize_t maxlen;   /* >= 1 */
    Py_ssize_t cap;      /* slots allocated: len <= cap <= maxlen */
    Py_ssize_t start;    /* the oldest entry's slot (0 until the ring is full) */
    Py_ssize_t len;
    PyObject **items;    /* cap * FIELDS references (PyMem), NULL while cap is 0 */
    PyObject *weakreflist;  /* weakly referenceable, as a deque */
} Recorder;

static PyTypeObject Recorder_Type;

/* Record one entry (the five fields, borrowed): 0, or -1 with MemoryError and nothing
   changed. */
static int
recorder_put(Recorder *r, PyObject *const *fields)
{
    PyObject *old[FIELDS], **slot;
    int j;
    if (r->len < r->maxlen) {
        if (r->len == r->cap) {  /* not full yet: entries are at [0, len), start is 0 */
            Py_ssize_t cap = r->cap ? r->cap * 2 : 8;
            PyObject **items;
            if (cap > r->maxlen)
                cap = r->maxlen;
            if ((size_t)cap > PY_SSIZE_T_MAX / (FIELDS * sizeof(PyObject *))) {
                PyErr_NoMemory();
                return -1;
            }
            items = PyMem_Realloc(r->items, (size_t)cap * FIELDS * sizeof(PyObject *));
            if (items == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            r->items = items;
            r->cap = cap;
        }
        slot = r->items + r->len * FIELDS;
        for (j = 0; j < FIELDS; j++)
            slot[j] = Py_NewRef(fields[j]);
        r->len++;
        return 0;
    }
    slot = r->items + r->start * FIELDS;  /* full: the oldest entry's slot takes the new one */
    for (j = 0; j < FIELDS; j++) {
        old[j] = slot[j];
        slot[j] = Py_NewRef(fields[j]);
    }
    r->start = r->start + 1 == r->maxlen ? 0 : r->start + 1;
    for (j = 0; j < FIELDS; j++)  /* last: the ring is whole before anything can run */
        Py_DECREF(old[j]);
    return 0;
}

static PyObject *s_empty;  /* "empty": the op of an entry that folds calls with no ids */
static PyObject *s_one;    /* 1 */

/* Whether ``op`` and ``count`` are those of an entry folding empty calls, as Python's
   ``evidence.fold_empty`` asks (``last[4] == "empty"``; its count an exact int). */
static int
folds_empty(PyObject *op, PyObject *count)
{
    return PyUnicode_CheckExact(op) && PyUnicode_Compare(op, s_empty) == 0 &&
           PyLong_CheckExact(count);
}

/* Count call ``clock``, which carried no ids, as ``evidence.fold_empty`` does: the newest entry,
   when it folds empty calls already, becomes ``(clock, n + 1, None, None, "empty")`` in place;
   else a fold of one is recorded. 0, or -1 with an error and nothing changed. */
static int
recorder_fold(Recorder *r, PyObject *clock)
{
    PyObject **slot, *count, *old_clock, *old_count;
    if (r->len) {
        slot = r->items + ((r->start + r->len - 1) % r->maxlen) * FIELDS;
        if (folds_empty(slot[4], slot[1])) {
            count = PyNumber_Add(slot[1], s_one);  /* exact ints: runs no code */
            if (count == NULL)
                return -1;
            old_clock = slot[0];
            old_count = slot[1];
            slot[0] = Py_NewRef(clock);
            slot[1] = count;
            Py_DECREF(old_clock);  /* last: the ring is whole before anything can run */
            Py_DECREF(old_count);
            return 0;
        }
    }
    {
        PyObject *fields[FIELDS] = {clock, s_one, Py_None, Py_None, s_empty};
        return recorder_put(r, fields);
    }
}

/* Entry i (0 = oldest, 0 <= i < len when called) as a new tuple; NULL with an error, or NULL
   without one when the entry is gone (the tuple's allocation ran code that cleared it). */
static PyObject *
recorder_entry(Recorder *r, Py_ssize_t i)
{
    PyObject *t = PyTuple_New(FIELDS), **slot;
    int j;
    if (t == NULL)
        return NULL;
    if (i >= r->len) {
        Py_DECREF(t);
        return NULL;
    }
    slot = r->items + ((r->start + i) % r->maxlen) * FIELDS;
    for (j = 0; j < FIELDS; j++)
        PyTuple_SET_ITEM(t, j, Py_NewRef(slot[j]));
    return t;
}

static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"maxlen", NULL};
    Py_ssize_t maxlen;
    Recorder *r;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:FlightRecorder", kwlist, &maxlen))
        return NULL;
    if (maxlen < 1) {
        PyErr_SetString(PyExc_ValueError, "maxlen must be at least 1");
        return NULL;
    }
    r = (Recorder *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    r->maxlen = maxlen;
    return (PyObject *)r;
}

/* Drop every entry: the ring is emptied first, the references dropped after. */
static void
recorder_drop(Recorder *r)
{
    PyObject **items = r->items;
    Py_ssize_t n = r->len, i;
    r->items = NULL;
    r->cap = r->len = r->start = 0;
    for (i = 0; i < n * FIELDS; i++)
        Py_DECREF(items[i]);
    PyMem_Free(items);
}

static int
recorder_traverse(Recorder *r, visitproc visit, void *arg)
{
    Py_ssize_t i;
    for (i = 0; i < r->len * FIELDS; i++)
        Py_VISIT(r->items[i]);
    return 0;
}

static int
recorder_clear(Recorder *r)
{
    recorder_drop(r);
    return 0;
}

static void
recorder_dealloc(Recorder *r)
{
    PyObject_GC_UnTrack(r);
    Py_TRASHCAN_BEGIN(r, recorder_dealloc)
    if (r->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)r);
    recorder_drop(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
    Py_TRASHCAN_END
}

static Py_ssize_t
recorder_length(Recorder *r)
{
    return r->len;
}

static PyObject *
recorder_item(Recorder *r, Py_ssize_t i)
{
    PyObject *t = i < 0 || i >= r->len ? NULL : recorder_entry(r, i);
    if (t == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_IndexError, "flight recorder index out of range");
    return t;
}

/* ``r[i] = entry`` (negative i too), as on a deque: entry i's fields replaced by a 5-tuple's.
   Deleting an entry is not supported. */
static int
recorder_ass_item(Recorder *r, Py_ssize_t i, PyObject *entry)
{
    PyObject *old[FIELDS], **slot;
    int j;
    if (entry == NULL) {
        PyErr_SetString(PyExc_TypeError, "flight recorder entries cannot be deleted");
        return -1;
    }
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != FIELDS) {
        PyErr_Format(PyExc_TypeError, "a flight-recorder entry is a (call, ids, site, pool, op) "
                     "tuple, not %.100s", Py_TYPE(entry)->tp_name);
        return -1;
    }
    if (i < 0 || i >= r->len) {
        PyErr_SetString(PyExc_IndexError, "flight recorder assignment index out of range");
        return -1;
    }
    slot = r->items + ((r->start + i) % r->maxlen) * FIELDS;
    for (j = 0; j < FIELDS; j++) {
        old[j] = slot[j];
        slot[j] = Py_NewRef(PyTuple_GET_ITEM(entry, j));
    }
    for (j = 0; j < FIELDS; j++)  /* last: the ring is whole before anything can run */
        Py_DECREF(old[j]);
    return 0;
}

/* The entries, oldest first, as a new list of tuples: one state of the recorder. Every tuple
   is allocated first (an allocation may run the collector, and code it runs may append to or
   clear the recorder), then all are filled with no allocation in between; a list longer than
   the recorder is by then is cut to its length (dropping empty tuples runs no code). */
static PyObject *
recorder_list(Recorder *r)
{
    Py_ssize_t n = r->len, i, j;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *t = PyTuple_New(FIELDS);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    if (r->len < n && PyList_SetSlice(out, r->len, n, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    n = PyList_GET_SIZE(out);
    for (i = 0; i < n; i++) {
        PyObject **slot = r->items + ((r->start + i) % r->maxlen) * FIELDS;
        for (j = 0; j < FIELDS; j++)
            PyTuple_SET_ITEM(PyList_GET_ITEM(out, i), j, Py_NewRef(slot[j]));
    }
    return out;
}

static PyObject *
recorder_iter(Recorder *r)
{
    PyObject *snapshot = recorder_list(r), *it;
    if (snapshot == NULL)
        return NULL;
    it = PyObject_GetIter(snapshot);
    Py_DECREF(snapshot);
    return it;
}

static PyObject *
recorder_append(Recorder *r, PyObject *entry)
{
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != FIELDS) {
        PyErr_Format(PyExc_TypeError, "a flight-recorder entry is a (call, ids, site, pool, op) "
                     "tuple, not %.100s", Py_TYPE(entry)->tp_name);
        return NULL;
    }
    if (recorder_put(r, PySequence_Fast_ITEMS(entry)) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
recorder_clear_py(Recorder *r, PyObject *Py_UNUSED(arg))
{
    recorder_drop(r);
    Py_RETURN_NONE;
}

/* copy, deepcopy and pickle: FlightRecorder(maxlen), then its entries appended in order */
static PyObject *
recorder_reduce(Recorder *r, PyObject *Py_UNUSED(arg))
{
    PyObject *entries = recorder_iter(r), *out;
    if (entries == NULL)
        return NULL;
    out = Py_BuildValue("O(n)OO", (PyObject *)Py_TYPE(r), r->maxlen, Py_None, entries);
    Py_DECREF(entries);
    return out;
}

static PyObject *
recorder_repr(Recorder *r)
{
    PyObject *entries, *out;
    int rc = Py_ReprEnter((PyObject *)r);
    if (rc != 0)
        return rc > 0 ? PyUnicode_FromString("[...]") : NULL;
    entries = recorder_list(r);
    out = entries == NULL ? NULL
                          : PyUnicode_FromFormat("FlightRecorder(%R, maxlen=%zd)", entries,
                                                 r->maxlen);
    Py_XDECREF(entries);
    Py_ReprLeave((PyObject *)r);
    return out;
}

static PyMethodDef recorder_methods[] = {
    {"append", (PyCFunction)recorder_append, METH_O,
     "Record one (call, ids, site, pool, op) entry; the oldest goes when full."},
    {"clear", (PyCFunction)recorder_clear_py, METH_NOARGS, "Drop every entry."},
    {"__reduce__", (PyCFunction)recorder_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef recorder_members[] = {
    {"maxlen", T_PYSSIZET, offsetof(Recorder, maxlen), READONLY,
     "How many entries it keeps."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods recorder_as_sequence = {
    .sq_length = (lenfunc)recorder_length,
    .sq_item = (ssizeargfunc)recorder_item,
    .sq_ass_item = (ssizeobjargproc)recorder_ass_item,
};

static PyTypeObject Recorder_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.FlightRecorder",
    .tp_basicsize = sizeof(Recorder),
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_repr = (reprfunc)recorder_repr,
    .tp_as_sequence = &recorder_as_sequence,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A guard's flight recorder: the last maxlen (call, ids, site, pool, op) entries.",
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_iter = (getiterfunc)recorder_iter,
    .tp_methods = recorder_methods,
    .tp_members = recorder_members,
    .tp_weaklistoffset = offsetof(Recorder, weakreflist),
    .tp_new = recorder_new,
};

/* --- the guard's lock ---------------------------------------------------------------------- */

/* GuardLock: a reentrant lock with threading.RLock's interface and behaviour (acquire(blocking,
   timeout), release(), the context manager, _is_owned, _release_save/_acquire_restore for
   threading.Condition, _at_fork_reinit), made for the compiled wrappers, which take and drop
   it inline: an RLock costs them three Python-level calls per guarded call, and CPython's
   RLock.acquire parses its arguments and reads the clock (PyThread_acquire_lock_timed does,
   even for a try that does not wait) on every call.

   Its state (owner, count, waiters, posted) is read and written only with the GIL held, so
   the GIL is what makes each step atomic, as for CPython's RLock's owner and count: an
   uncontended acquire or release is a few integer writes and no system call. Only a thread
   that finds the lock held by another waits, on ``gate``, an OS lock kept acquired, with the
   GIL released; a release that leaves waiters posts the gate once (``posted``) to wake one.
   A woken waiter takes the lock if it is free when it has the GIL back, else waits again
   (another thread may have taken it in between), so a post is never lost: either a waiter
   consumes it and re-checks, or it is still pending for the next. kvguard uses it as
   ``Guard.lock`` only with the compiled wrappers; a free-threaded interpreter running without
   the GIL never loads this module (kvguard.guard.shadowing). */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock gate; /* acquired, except while a post for waiters is pending */
    unsigned long owner;     /* the holding thread's PyThread_get_thread_ident() (0: none) */
    unsigned long count;     /* re-entry depth; 0: free */
    Py_ssize_t waiters;      /* threads in glock_wait (blocked on the gate, or about to be) */
    int posted;              /* the gate was released for waiters and no waiter took it yet */
    int reserved;            /* freed with waiters: handed to the waiter that takes the post */
    PyObject *weakreflist;
} GuardLock;

static PyTypeObject GuardLock_Type;

/* The monotonic clock in microseconds, read in C as CPython's own lock waits read it (never
   time.monotonic, which a test may have patched or frozen); -1 with an error set. Only timed
   waits read it. */
static int
now_us(double *out)
{
#ifdef MS_WINDOWS
    *out = (double)GetTickCount64() * 1e3;
    return 0;
#else
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    *out = (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
    return 0;
#endif
}

/* Wait for the lock held by another thread, then take it for ``me``, as CPython's
   acquire_timed waits: with the GIL released, interruptible (``intr``): an interruption runs
   the signal handlers and an exception they raise ends the wait. us < 0: no time limit
   (us == 0 is the caller's: it does not wait). 1: taken, 0: timed out, -1: an exception. */
static int
glock_wait(GuardLock *L, unsigned long me, long long us, int intr)
{
    double deadline = 0.0;
    PyLockStatus r;
    int rc;
    if (us > 0) {
        if (now_us(&deadline) < 0)
            return -1;
        deadline += (double)us;
    }
    L->waiters++;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(L->gate, (PY_TIMEOUT_T)us, intr);
        Py_END_ALLOW_THREADS
        if (r == PY_LOCK_ACQUIRED) {
            L->posted = 0;  /* the post was for us: the gate is acquired again */
            if (L->reserved) {  /* handed to us by the release */
                L->reserved = 0;
                goto take;
            }
        }
        if (L->count == 0 && !L->reserved)
            goto take;
        /* still held (taken by another thread before we had the GIL back): wait again */
        if (r == PY_LOCK_INTR && Py_MakePendingCalls() < 0) {
            rc = -1;
            goto leave;
        }
        if (us > 0) {
            double t;
            if (now_us(&t) < 0) {
                rc = -1;
                goto leave;
            }
            if (t >= deadline) {
                rc = 0;
                goto leave;
            }
            us = (long long)(deadline - t) + 1;
        }
    }
take:
    L->waiters--;
    L->owner = me;
    L->count = 1;
    return 1;
leave:
    L->waiters--;
    if (L->waiters == 0 && L->reserved) {
        /* handed to waiters that all left: take the post back, the lock is free */
        if (L->posted && PyThread_acquire_lock(L->gate, NOWAIT_LOCK))
            L->posted = 0;
        L->reserved = 0;
    }
    return rc;
}

/* acquire() for thread ``me``: 1 taken (or re-entered), 0 not (us == 0, or timed out), -1
   with an exception (a count overflow, or a signal handler's). us as in glock_wait. */
static int
glock_acquire(GuardLock *L, unsigned long me, long long us)
{
    if (L->count == 0 && !L->reserved) {
        L->owner = me;
        L->count = 1;
        return 1;
    }
    if (L->owner == me) {
        if (L->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "Internal lock count overflowed");
            return -1;
        }
        L->count++;
        return 1;
    }
    if (us == 0)
        return 0;
    return glock_wait(L, me, us, 1);
}

/* The lock is free now (count just went to 0): wake one waiter, if any. */
static void
glock_freed(GuardLock *L)
{
    L->owner = 0;
    if (L->waiters > 0) {
        L->reserved = 1;  /* handed off: a barging acquire must not take it first */
        if (!L->posted) {
            L->posted = 1;
            PyThread_release_lock(L->gate);
        }
    }
}

/* release() for thread ``me``: RuntimeError, as RLock's, when ``me`` does not hold it. */
static int
glock_release(GuardLock *L, unsigned long me)
{
    if (L->count == 0 || L->owner != me) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--L->count == 0)
        glock_freed(L);
    return 0;
}

/* A new gate, acquired. NULL with MemoryError. */
static PyThread_type_lock
new_gate(void)
{
    PyThread_type_lock gate = PyThread_allocate_lock();
    if (gate == NULL) {
        PyErr_SetString(PyExc_MemoryError, "cannot allocate lock");
        return NULL;
    }
    if (!PyThread_acquire_lock(gate, NOWAIT_LOCK)) {  /* a new lock is free: cannot fail */
        PyThread_free_lock(gate);
        PyErr_SetString(PyExc_RuntimeError, "cannot acquire a new lock");
        return NULL;
    }
    return gate;
}

static PyObject *
glock_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    GuardLock *L;
    PyThread_type_lock gate;
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "GuardLock() takes no arguments");
        return NULL;
    }
    gate = new_gate();
    if (gate == NULL)
        return NULL;
    L = (GuardLock *)type->tp_alloc(type, 0);
    if (L == NULL) {
        PyThread_release_lock(gate);
        PyThread_free_lock(gate);
        return NULL;
    }
    L->gate = gate;
    return (PyObject *)L;
}

static void
glock_dealloc(GuardLock *L)
{
    if (L->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)L);
    if (L->gate != NULL) {
        /* no thread waits (a waiter holds a reference): the gate is acquired unless posted */
        if (!L->posted)
            PyThread_release_lock(L->gate);  /* freed unlocked, as CPython frees its locks */
        PyThread_free_lock(L->gate);
    }
    Py_TYPE(L)->tp_free((PyObject *)L);
}

/* acquire(blocking=True, timeout=-1) -> bool, with RLock's argument rules. */
static PyObject *
glock_acquire_py(GuardLock *L, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"blocking", "timeout", NULL};
    int blocking = 1, r;
    PyObject *timeout_obj = NULL;
    long long us = -1;
    if (PyTuple_GET_SIZE(args) || kwds != NULL) {
        if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pO:acquire", kwlist, &blocking,
                                         &timeout_obj))
            return NULL;
    }
    if (timeout_obj != NULL) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (t != t) {
            PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
            return NULL;
        }
        if (t != -1.0) {
            if (!blocking) {
                PyErr_SetString(PyExc_ValueError,
                                "can't specify a timeout for a non-blocking call");
                return NULL;
            }
            if (t < 0) {
                PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
                return NULL;
            }
            t *= 1e6;
            if (t >= (double)PY_TIMEOUT_MAX) {
                PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
                return NULL;
            }
            us = (long long)t;
            if ((double)us < t)
                us++;  /* rounded up: a timeout never waits less than asked */
        }
    }
    if (!blocking)
        us = 0;
    r = glock_acquire(L, PyThread_get_thread_ident(), us);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
glock_enter(GuardLock *L, PyObject *Py_UNUSED(arg))
{
    int r = glock_acquire(L, PyThread_get_thread_ident(), -1);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
glock_release_py(GuardLock *L, PyObject *Py_UNUSED(arg))
{
    if (glock_release(L, PyThread_get_thread_ident()) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
glock_exit(GuardLock *L, PyObject *Py_UNUSED(args))
{
    return glock_release_py(L, NULL);
}

static PyObject *
glock_is_owned(GuardLock *L, PyObject *Py_UNUSED(arg))
{
    return PyBool_FromLong(L->count > 0 && L->owner == PyThread_get_thread_ident());
}

/* threading.Condition's protocol: drop every level at once, then take them back. As RLock's:
   _release_save checks only that the lock is held, _acquire_restore waits uninterruptibly
   (Condition.wait calls it in a ``finally``). */
static PyObject *
glock_release_save(GuardLock *L, PyObject *Py_UNUSED(arg))
{
    unsigned long owner, count;
    if (L->count == 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    owner = L->owner;
    count = L->count;
    L->count = 0;
    glock_freed(L);
    return Py_BuildValue("(kk)", count, owner);
}

static PyObject *
glock_acquire_restore(GuardLock *L, PyObject *args)
{
    unsigned long owner, count;
    unsigned long me = PyThread_get_thread_ident();
    if (!PyArg_ParseTuple(args, "(kk):_acquire_restore", &count, &owner))
        return NULL;
    if ((L->count > 0 || L->reserved) && glock_wait(L, me, -1, 0) < 0)  /* not interruptible: 1 or -1 */
        return NULL;
    L->owner = owner;
    L->count = count;
    if (count == 0)  /* a state no _release_save gives; kept consistent all the same */
        glock_freed(L);
    Py_RETURN_NONE;
}

/* In a forked child: free, with a new gate. The old gate is left as it is (a thread of the
   parent may have been waiting on it: it is in no state to free), as CPython leaves its
   locks' at fork. */
static PyObject *
glock_at_fork_reinit(GuardLock *L, PyObject *Py_UNUSED(arg))
{
    PyThread_type_lock gate = new_gate();
    if (gate == NULL)
        return NULL;
    L->gate = gate;
    L->owner = 0;
    L->count = 0;
    L->waiters = 0;
    L->posted = 0;
    L->reserved = 0;
    Py_RETURN_NONE;
}

static PyObject *
glock_repr(GuardLock *L)
{
    return PyUnicode_FromFormat("<%s %s object owner=%lu count=%lu at %p>",
                                L->count ? "locked" : "unlocked", Py_TYPE(L)->tp_name,
                                L->owner, L->count, (void *)L);
}

static PyMethodDef glock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))glock_acquire_py, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool: as threading.RLock's."},
    {"release", (PyCFunction)glock_release_py, METH_NOARGS,
     "Drop one level; RuntimeError when this thread does not hold the lock."},
    {"__enter__", (PyCFunction)glock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)glock_exit, METH_VARARGS, NULL},
    {"_is_owned", (PyCFunction)glock_is_owned, METH_NOARGS,
     "Whether this thread holds the lock."},
    {"_release_save", (PyCFunction)glock_release_save, METH_NOARGS, NULL},
    {"_acquire_restore", (PyCFunction)glock_acquire_restore, METH_VARARGS, NULL},
    {"_at_fork_reinit", (PyCFunction)glock_at_fork_reinit, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GuardLock_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.GuardLock",
    .tp_basicsize = sizeof(GuardLock),
    .tp_dealloc = (destructor)glock_dealloc,
    .tp_repr = (reprfunc)glock_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The guard's reentrant lock (threading.RLock's interface), taken inline by the "
              "compiled wrappers.",
    .tp_weaklistoffset = offsetof(GuardLock, weakreflist),
    .tp_methods = glock_methods,
    .tp_new = glock_new,
};

/* --- attributes of block objects ------------------------------------------------------------ */

/* Where an attribute of one type of object is, once looked up: engines' block objects keep
   their id, refcount and flags in __slots__ (vLLM's KVCacheBlock is a slotted dataclass), and
   ``getattr`` by name costs more than the rest of a block's checks. The slot is read straight
   from the object while its type is the one looked up and has not changed since: Python gives
   a type a new version tag whenever it or a base is modified (the tag CPython's own attribute
   caches rely on), so the same type with the same tag has the same attribute. Anything else
   (no tag, a type with its own __getattribute__ or __getattr__, an attribute that is not a
   plain object slot, a slot not set) is read by ``getattr`` as before. */
typedef struct {
    PyObject *type;          /* the type looked up (a strong reference), or NULL */
    unsigned int tag;        /* its version tag then (never 0 here) */
    Py_ssize_t offset;       /* the slot's offset in its objects, -1: not a plain slot */
} SlotCache;

static void
slot_learn(SlotCache *sc, PyTypeObject *tp, PyObject *name)
{
    Py_ssize_t offset = -1;
    PyObject *d, *old;
    if (tp->tp_getattro == PyObject_GenericGetAttr && PyUnicode_CheckExact(name)) {
        d = _PyType_Lookup(tp, name);  /* borrowed; gives the type a version tag if it can */
        if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type) &&
            PyType_IsSubtype(tp, PyDescr_TYPE(d))) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            /* a data descriptor: it comes before any instance __dict__ */
            if (m->type == T_OBJECT_EX && !(m->flags & PY_AUDIT_READ))
                offset = m->offset;
        }
    }
    if (tp->tp_version_tag == 0 || !PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG))
        return;  /* no tag to tell a change by: nothing cached */
    old = sc->type;
    sc->type = Py_NewRef((PyObject *)tp);
    sc->tag = tp->tp_version_tag;
    sc->offset = offset;
    Py_XDECREF(old);  /* last: freeing the old type may run code; the cache is whole by now */
}

/* ``getattr(obj, name)``, from the slot when ``sc`` knows where it is. */
static PyObject *
get_slot(SlotCache *sc, PyObject *obj, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject *v;
    if ((PyObject *)tp == sc->type && tp->tp_version_tag == sc->tag &&
        PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG)) {
        if (sc->offset >= 0) {
            v = *(PyObject **)((char *)obj + sc->offset);
            if (v != NULL)
                return Py_NewRef(v);
        }
        return PyObject_GetAttr(obj, name);  /* not a slot, or not set: its own error */
    }
    v = PyObject_GetAttr(obj, name);
    if (v != NULL)
        slot_learn(sc, tp, name);
    return v;
}

#define SLOT_PAIRS 4  /* keeps_all identities with a cache each; more are read by getattr */

/* --- the holder slot ------------------------------------------------------------------------ */

/* [owners] The holder an engine's request boundary set on this thread, or -1: none, the context
   variable ACTIVE_HOLDER says. A boundary runs synchronously (nothing else runs on its thread
   until it returns), so a thread's own slot is enough there, and saving and restoring a C
   integer costs nothing beside the context variable's set and reset, which allocate. A
   ``kvguard.owner`` entered inside a boundary clears the slot for its block (swap_holder(-1)),
   so the innermost of the two always decides. */
static _Thread_local long long holder_slot = -1;
static PyObject *holder_var_bound = NULL;   /* ACTIVE_HOLDER (bind_holders) */
static PyObject *owner_index = NULL;        /* OWNERS.index: label -> number */
static PyObject *owner_intern = NULL;       /* OWNERS.intern(label) -> number */

/* The holder's number for ``label`` (0 for None), interned as OWNERS.intern does; -1 with an
   error set. */
static long long
holder_index(PyObject *label)
{
    PyObject *n;
    long long out;
    int valid;
    if (label == Py_None)
        return 0;
    if (owner_index == NULL || owner_intern == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvguard._fastpath: bind_holders() was not called");
        return -1;
    }
    n = PyDict_GetItemWithError(owner_index, label);  /* borrowed */
    if (n != NULL) {
        out = as_ll(n, &valid);
        if (valid && out >= 0 && out < SEVERAL)
            return out;
    }
    else if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))  /* unhashable: intern() uses its repr */
            return -1;
        PyErr_Clear();
    }
    n = PyObject_CallOneArg(owner_intern, label);
    if (n == NULL)
        return -1;
    out = as_ll(n, &valid);
    Py_DECREF(n);
    if (!valid || out < 0 || out >= SEVERAL) {
        PyErr_SetString(PyExc_TypeError, "OWNERS.intern() must return a small int");
        return -1;
    }
    return out;
}

static PyObject *
fp_bind_holders(PyObject *mod, PyObject *args)
{
    PyObject *var, *index, *intern;
    if (!PyArg_ParseTuple(args, "O!O!O:bind_holders", &PyContextVar_Type, &var, &PyDict_Type,
                          &index, &intern))
        return NULL;
    if (!PyCallable_Check(intern)) {
        PyErr_SetString(PyExc_TypeError, "bind_holders: intern must be callable");
        return NULL;
    }
    Py_XSETREF(holder_var_bound, Py_NewRef(var));
    Py_XSETREF(owner_index, Py_NewRef(index));
    Py_XSETREF(owner_intern, Py_NewRef(intern));
    Py_RETURN_NONE;
}

/* The holder in force: this thread's slot when a boundary set it, else ``var``'s value (0 when
   unset); -1 with an error set. A value that is not a small int reads as 0 with *exact 0. */
static long long
holder_in_force(PyObject *var, int *exact)
{
    PyObject *v = NULL;
    long long out;
    int valid;
    *exact = 1;
    if (holder_slot >= 0)
        return holder_slot;
    if (var == NULL)
        return 0;
    if (holder_var_bound == NULL) {
        /* kvguard.owners keeps its slot in Python (KVGUARD_PURE=1, and a test using these
           wrappers all the same): ask it */
        static PyObject *py_holder_now = NULL;
        if (py_holder_now == NULL) {
            PyObject *owners = PyImport_ImportModule("kvguard.owners");
            if (owners == NULL)
                return -1;
            py_holder_now = PyObject_GetAttrString(owners, "holder_now");
            Py_DECREF(owners);
            if (py_holder_now == NULL)
                return -1;
        }
        v = PyObject_CallNoArgs(py_holder_now);
        if (v == NULL)
            return -1;
    }
    else if (PyContextVar_Get(var, NULL, &v) < 0)
        return -1;
    if (v == NULL)
        return 0;
    out = as_ll(v, &valid);
    Py_DECREF(v);
    *exact = valid && out >= 0 && out < SEVERAL;
    return *exact ? out : 0;
}

static PyObject *
fp_holder_now(PyObject *mod, PyObject *unused)
{
    int exact;
    long long h = holder_in_force(holder_var_bound, &exact);
    if (h < 0 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(h);
}

static PyObject *
fp_swap_holder(PyObject *mod, PyObject *arg)
{
    long long old = holder_slot, v;
    int overflow = 0;
    if (!PyLong_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "swap_holder() takes an int");
        return NULL;
    }
    v = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (overflow || v < -1 || v >= SEVERAL) {
        PyErr_SetString(PyExc_ValueError, "swap_holder(): -1 or a holder's number");
        return NULL;
    }
    holder_slot = v;
    return PyLong_FromLongLong(old);
}

static PyMethodDef fastpath_functions[] = {
    {"bind_holders", fp_bind_holders, METH_VARARGS,
     "bind_holders(ACTIVE_HOLDER, OWNERS.index, OWNERS.intern): where holders are read."},
    {"holder_now", fp_holder_now, METH_NOARGS,
     "The holder in force on this thread: a boundary's, else ACTIVE_HOLDER's (0: none)."},
    {"swap_holder", fp_swap_holder, METH_O,
     "swap_holder(n) -> old: set this thread's boundary holder (-1: none), return the old one."},
    {NULL, NULL, 0, NULL},
};

/* ``with holding(request_id):`` the holder of a synchronous block (an engine adapter's request
   boundary): the label interned once, the slot saved and set on entry, restored on exit. */
typedef struct {
    PyObject_HEAD
    long long index, saved;
} Holding;

static PyObject *
holding_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *label;
    Holding *self;
    long long index;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "holding() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "holding", 1, 1, &label))
        return NULL;
    index = holder_index(label);
    if (index < 0)
        return NULL;
    self = (Holding *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->index = index;
    self->saved = -1;
    return (PyObject *)self;
}

/* ``holding(label)`` without building an argument tuple (called once per request per step). */
static PyObject *
holding_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Holding *self;
    long long index;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "holding() takes exactly one argument (the holder)");
        return NULL;
    }
    index = holder_index(args[0]);
    if (index < 0)
        return NULL;
    self = (Holding *)((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, 0);
    if (self == NULL)
        return NULL;
    self->index = index;
    self->saved = -1;
    return (PyObject *)self;
}

static PyObject *
holding_enter(Holding *self, PyObject *unused)
{
    self->saved = holder_slot;
    holder_slot = self->index;
    return Py_NewRef(self);
}

static PyObject *
holding_exit(Holding *self, PyObject *const *args, Py_ssize_t nargs)
{
    holder_slot = self->saved;
    Py_RETURN_NONE;
}

static PyMethodDef holding_methods[] = {
    {"__enter__", (PyCFunction)holding_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))holding_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef holding_members[] = {
    {"index", T_LONGLONG, offsetof(Holding, index), READONLY, "the holder's interned number"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject Holding_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.Holding",
    .tp_basicsize = sizeof(Holding),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "holding(label): run a synchronous block as the holder ``label`` "
              "(the holding of kvguard's owners module).",
    .tp_methods = holding_methods,
    .tp_members = holding_members,
    .tp_new = holding_new,
    .tp_vectorcall = holding_vectorcall,
};

/* A request boundary: an engine method run as the holder one of its arguments names
   (``Boundary(original, skip, position, name, attr)``: the argument at ``skip + position`` or
   passed as ``name``, its attribute ``attr`` when not None). Installed on the class, so it binds
   like a function; ``skip`` is 1 there (the instance comes first). A reader that fails, or a
   holder of None, runs the method as it is. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original, *name, *attr;
    Py_ssize_t skip, pos;
} Boundary;

static PyObject *
boundary_label(Boundary *b, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *value = NULL;
    Py_ssize_t i, nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (b->pos >= 0 && nargs > b->skip + b->pos)
        value = args[b->skip + b->pos];
    else if (b->name != Py_None) {
        for (i = 0; i < nkw && value == NULL; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (k == b->name || (PyUnicode_Check(k) && PyUnicode_Compare(k, b->name) == 0))
                value = args[nargs + i];
        }
    }
    if (value == NULL)
        return NULL;
    if (b->attr == Py_None)
        return Py_NewRef(value);
    value = PyObject_GetAttr(value, b->attr);
    if (value == NULL)
        PyErr_Clear();  /* not this engine's request: the method decides */
    return value;
}

static PyObject *
boundary_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Boundary *b = (Boundary *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *label = boundary_label(b, args, nargs, kwnames), *result;
    long long index, saved;
    if (b->original == NULL) {
        Py_XDECREF(label);
        PyErr_SetString(PyExc_RuntimeError, "Boundary was cleared");
        return NULL;
    }
    if (label == NULL || label == Py_None) {
        Py_XDECREF(label);
        return PyObject_Vectorcall(b->original, args, nargsf, kwnames);
    }
    index = holder_index(label);
    Py_DECREF(label);
    if (index < 0) {
        PyErr_Clear();  /* kvguard's own failure never breaks the engine's call */
        return PyObject_Vectorcall(b->original, args, nargsf, kwnames);
    }
    saved = holder_slot;
    holder_slot = index;
    result = PyObject_Vectorcall(b->original, args, nargsf, kwnames);
    holder_slot = saved;
    return result;
}

static PyObject *
boundary_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"original", "skip", "position", "name", "attr", NULL};
    PyObject *original, *name = Py_None, *attr = Py_None;
    Py_ssize_t skip = 1, pos = -1;
    Boundary *b;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nnOO:Boundary", kwlist, &original, &skip,
                                     &pos, &name, &attr))
        return NULL;
    if (!PyCallable_Check(original) || skip < 0 || pos < -1
        || (name != Py_None && !PyUnicode_Check(name))
        || (attr != Py_None && !PyUnicode_Check(attr))) {
        PyErr_SetString(PyExc_TypeError, "Boundary(original callable, skip >= 0, position >= -1, "
                        "name str or None, attr str or None)");
        return NULL;
    }
    b = (Boundary *)type->tp_alloc(type, 0);
    if (b == NULL)
        return NULL;
    b->vectorcall = boundary_vectorcall;
    b->original = Py_NewRef(original);
    b->name = Py_NewRef(name);
    b->attr = Py_NewRef(attr);
    b->skip = skip;
    b->pos = pos;
    return (PyObject *)b;
}

static int
boundary_traverse(Boundary *b, visitproc visit, void *arg)
{
    Py_VISIT(b->dict);
    Py_VISIT(b->original);
    Py_VISIT(b->name);
    Py_VISIT(b->attr);
    return 0;
}

static int
boundary_clear(Boundary *b)
{
    Py_CLEAR(b->dict);
    Py_CLEAR(b->original);
    Py_CLEAR(b->name);
    Py_CLEAR(b->attr);
    return 0;
}

static void
boundary_dealloc(Boundary *b)
{
    PyObject_GC_UnTrack(b);
    boundary_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *
boundary_call(PyObject *self, PyObject *args, PyObject *kwds)
{
    Boundary *b = (Boundary *)self;
    if (b->original == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Boundary was cleared");
        return NULL;
    }
    return PyVectorcall_Call(self, args, kwds);
}

/* Bound like a function: ``instance.method`` is a bound method of the boundary. */
static PyObject *
boundary_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
boundary_get_original(Boundary *b, void *closure)
{
    return Py_NewRef(b->original ? b->original : Py_None);
}

static PyGetSetDef boundary_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"original", (getter)boundary_get_original, NULL, "the method this boundary runs", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Boundary_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.Boundary",
    .tp_basicsize = sizeof(Boundary),
    .tp_dealloc = (destructor)boundary_dealloc,
    .tp_vectorcall_offset = offsetof(Boundary, vectorcall),
    .tp_call = boundary_call,
    .tp_descr_get = boundary_descr_get,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A request boundary: the method run as the holder its call names.",
    .tp_traverse = (traverseproc)boundary_traverse,
    .tp_clear = (inquiry)boundary_clear,
    .tp_getset = boundary_getset,
    .tp_dictoffset = offsetof(Boundary, dict),
    .tp_new = boundary_new,
};

/* --- the wrapper object ------------------------------------------------------------------- */

enum { KIND_FREE = 0, KIND_SHARE = 1, KIND_ALLOC = 2 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *weakreflist;   /* weakref.ref(allocator.free) works, as on a function */
    int kind;
    PyObject *guard, *original;
    GuardLock *glock;        /* the guard's lock when it is a GuardLock (taken inline), or NULL */
    PyObject *owned, *acquire, *unlock;  /* any other lock's _is_owned, acquire, release */
    Py_ssize_t pos;          /* -1: none */
    PyObject *name;          /* the argument's keyword name, or None */
    PyObject *dflt;          /* its default (MISSING) */
    PyObject *read;          /* the Python reader, or None (no fast path) */
    int plain;               /* an exact int (and a list/tuple of them) is read here */
    PyObject *main;          /* Ledger.hot of a spec without sub-pools, or None */
    PyObject *ledger_of;     /* ledger_of(args, kwargs) -> hot or None, or None */
    int drain;
    PyObject *put;           /* Param.put, or None */
    PyObject *iterators;     /* fastread.ITERATORS */
    PyObject *stats;
    PyObject *history;       /* history.append, or None (a FlightRecorder: see recorder) */
    PyObject *log;           /* the history itself when it is not a FlightRecorder, or None */
    Recorder *recorder;      /* the guard's history when it is a FlightRecorder, or NULL */
    int depth;
    PyObject *capture;       /* guard._capture */
    PyObject *sites_index;   /* SITES._index when capture is SITES.capture, else None */
    PyObject *sites;         /* SITES (its _intern is looked up on a miss, as Python does) */
    PyObject *owner_var;     /* ACTIVE_OWNER */
    PyObject *tick;
    PyObject *slow;          /* the Python trampoline to the careful path */
    PyObject *engine_count;  /* refcount_attr's name (str), attrgetter(dotted), or None */
    PyObject *contain;
    /* The compiled readers (see read_ids): fastread's type -> kind table for plain specs;
       for ``id_attr`` specs the attribute, the skip, its keeps_all and the allocator. */
    PyObject *kinds;         /* dict, or None */
    /* What read_numpy learned from ``kinds`` and numpy (strong references, or NULL): the
       last numpy type read and its kind (kinds' entries never change once learned), a dtype
       object seen to be of kind "i" or "u" (a dtype's kind never changes), and the array
       type's own ``tolist`` method descriptor when looking it up on an instance can only find
       that (see numpy_kind); np_layout: the array type's instances were found laid out as
       numpy's PyArrayObject_fields (see np_layout_ok), so ndim and dtype are read in place;
       np_scalar: how the scalar type keeps its value (scalar_code; 0: read by ``index()``). */
    PyObject *np_type, *int_dtype, *np_tolist;
    int np_kind, np_layout, np_scalar;
    PyObject *id_attr;       /* str, or None: the Python reader reads */
    PyObject *skip, *keeps_all, *allocator;
    SlotCache id_slot, count_slot, pair_slot[SLOT_PAIRS];  /* id_attr, refcount_attr, pairs */
    /* where the call's two Guard.stats counters live (see counter_place) */
    CounterPlace off_calls, off_blocks;
    PyObject *tick_iter;     /* tick's iterator when tick is exactly its __next__, else NULL */
    PyObject *draw, *chance; /* a sampled capture over SITES: its generator and chance; None */
} Wrapper;

static PyTypeObject Wrapper_Type;

/* The call's arguments as Python sees them in ``release(*args, **kwargs)``: built on demand. */
typedef struct {
    PyObject *const *args;
    Py_ssize_t nargs;
    PyObject *kwnames;
    PyObject *targs;   /* owned, or NULL until needed */
    PyObject *tkw;
    int replaced;      /* targs/tkw were replaced by put(): call the original with them */
    PyObject **stack;  /* args with one replaced by put() (PyMem), or NULL */
} Call;

static int
call_materialize(Call *c)
{
    Py_ssize_t i, nkw;
    if (c->targs != NULL)
        return 0;
    c->targs = PyTuple_New(c->nargs);
    if (c->targs == NULL)
        return -1;
    for (i = 0; i < c->nargs; i++) {
        Py_INCREF(c->args[i]);
        PyTuple_SET_ITEM(c->targs, i, c->args[i]);
    }
    c->tkw = PyDict_New();
    if (c->tkw == NULL)
        return -1;
    nkw = c->kwnames ? PyTuple_GET_SIZE(c->kwnames) : 0;
    for (i = 0; i < nkw; i++) {
        if (PyDict_SetItem(c->tkw, PyTuple_GET_ITEM(c->kwnames, i), c->args[c->nargs + i]) < 0)
            return -1;
    }
    return 0;
}

static void
call_clear(Call *c)
{
    Py_CLEAR(c->targs);
    Py_CLEAR(c->tkw);
    if (c->stack != NULL)
        PyMem_Free(c->stack);
    c->stack = NULL;
}

/* ``args, kwargs = put(args, kwargs, value)``: the call forwards ``value`` in place of the ids
   it was given. ``put`` None: Param.put's own rule, here (by position when the call passed
   the argument by position, else by keyword in a copy of kwargs); the value is kept alive by
   the caller. */
static int
call_put(Wrapper *w, Call *c, PyObject *value)
{
    PyObject *r;
    if (w->put == Py_None) {
        if (w->pos >= 0 && c->nargs > w->pos && c->targs == NULL) {
            Py_ssize_t nkw = c->kwnames ? PyTuple_GET_SIZE(c->kwnames) : 0;
            PyObject **stack = PyMem_Malloc(sizeof(PyObject *) * (size_t)(c->nargs + nkw + 1));
            if (stack == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(stack, c->args, sizeof(PyObject *) * (size_t)(c->nargs + nkw));
            stack[w->pos] = value;  /* borrowed: the caller holds it for the call */
            if (c->stack != NULL)
                PyMem_Free(c->stack);
            c->stack = stack;
            c->args = stack;
            return 0;
        }
        if (call_materialize(c) < 0)
            return -1;
        if (w->pos >= 0 && PyTuple_GET_SIZE(c->targs) > w->pos) {
            Py_ssize_t i, n = PyTuple_GET_SIZE(c->targs);
            PyObject *t = PyTuple_New(n);
            if (t == NULL)
                return -1;
            for (i = 0; i < n; i++)
                PyTuple_SET_ITEM(t, i, Py_NewRef(i == w->pos ? value
                                                             : PyTuple_GET_ITEM(c->targs, i)));
            Py_SETREF(c->targs, t);
        }
        else {
            PyObject *d = PyDict_Copy(c->tkw);
            if (d == NULL)
                return -1;
            if (PyDict_SetItem(d, w->name, value) < 0) {
                Py_DECREF(d);
                return -1;
            }
            Py_SETREF(c->tkw, d);
        }
        c->replaced = 1;
        return 0;
    }
    if (call_materialize(c) < 0)
        return -1;
    r = PyObject_CallFunctionObjArgs(w->put, c->targs, c->tkw, value, NULL);
    if (r == NULL)
        return -1;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "put() must return (args, kwargs)");
        return -1;
    }
    Py_SETREF(c->targs, Py_NewRef(PyTuple_GET_ITEM(r, 0)));
    Py_SETREF(c->tkw, Py_NewRef(PyTuple_GET_ITEM(r, 1)));
    Py_DECREF(r);
    if (!PyTuple_Check(c->targs) || !PyDict_Check(c->tkw)) {
        PyErr_SetString(PyExc_TypeError, "put() must return (tuple, dict)");
        return -1;
    }
    c->replaced = 1;
    return 0;
}

static PyObject *
call_original(Wrapper *w, Call *c)
{
    if (c->replaced)
        return PyObject_Call(w->original, c->targs, c->tkw);
    return PyObject_Vectorcall(w->original, c->args, c->nargs, c->kwnames);
}

/* ``args[pos]`` else ``kwargs.get(name, default)``: a borrowed reference. */
static PyObject *
call_value(Wrapper *w, Call *c)
{
    Py_ssize_t i, nkw;
    if (w->pos >= 0 && w->pos < c->nargs)
        return c->args[w->pos];
    nkw = c->kwnames ? PyTuple_GET_SIZE(c->kwnames) : 0;
    if (w->name != Py_None) {
        for (i = 0; i < nkw; i++) {
            PyObject *k = PyTuple_GET_ITEM(c->kwnames, i);
            if (k == w->name)
                return c->args[c->nargs + i];
        }
        for (i = 0; i < nkw; i++) {
            PyObject *k = PyTuple_GET_ITEM(c->kwnames, i);
            if (PyUnicode_Check(k) && PyUnicode_Compare(k, w->name) == 0)
                return c->args[c->nargs + i];
        }
    }
    return w->dflt;
}

#define truthy PyObject_IsTrue

static PyObject *
owner_now(Wrapper *w)
{
    PyObject *v = NULL;
    if (PyContextVar_CheckExact(w->owner_var)) {
        if (PyContextVar_Get(w->owner_var, NULL, &v) < 0)
            return NULL;
        if (v != NULL)
            return v;
    }
    return PyObject_CallMethod(w->owner_var, "get", NULL);
}

/* A site seen before is found without building its key: a direct-mapped cache from the raw
   frames (code object addresses, instruction offsets) and the owner to the interned site. Only
   keys found in SITES' index are cached: the table keeps every code object of every key it
   holds alive (and forgets none), so an address in the cache cannot be reused by another code
   object. */
#define CACHE_SLOTS 1024
#define CACHE_FRAMES 8

typedef struct {
    PyObject *index;    /* the site table's index the site came from (a strong reference) */
    long owner;
    int n;
    void *code[CACHE_FRAMES];
    int lasti[CACHE_FRAMES];
    PyObject *site;
} SiteCacheEntry;

static SiteCacheEntry site_cache[CACHE_SLOTS];

static size_t
cache_slot(long owner, int n, void *const *code, const int *lasti)
{
    size_t h = (size_t)owner * 0x9E3779B97F4A7C15ull + (size_t)n;
    int i;
    for (i = 0; i < n; i++) {
        h ^= ((size_t)code[i] >> 4) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
        h ^= (size_t)lasti[i] * 0xC2B2AE3D27D4EB4Full + (h << 6) + (h >> 2);
    }
    return (h ^ (h >> 29)) & (CACHE_SLOTS - 1);
}

static int
frame_lasti(PyFrameObject *f)
{
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return f->f_lasti < 0 ? -1 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
}

/* SITES.capture(depth, limit, owner) for the caller of the wrapper, in C: the same key, the
   same interned site. A site seen for the first time is interned by SITES._intern. */
static PyObject *
capture_native(Wrapper *w, int limit, PyObject *owner)
{
    PyObject *key, *site, *zero, *res;
    PyFrameObject *f;
    Py_ssize_t n = 0, i;
    PyObject *parts[1 + 2 * 64];
    PyObject **heap = NULL, **items = parts;
    long owner_long = 0;
    int cacheable = 0, nframes = 0;
    void *codes[CACHE_FRAMES];
    int lastis[CACHE_FRAMES];
    size_t slot = 0;

    if (!limit) {
        int t = truthy(owner);
        if (t < 0)
            return NULL;
        if (!t)
            return PyLong_FromLong(0);
        key = PyTuple_Pack(1, owner);
    }
    else {
        f = PyEval_GetFrame();  /* borrowed: the caller of the wrapper */
        if (f == NULL) {  /* no Python caller: the Python capture says what that is */
            zero = PyLong_FromLong(0);
            if (zero == NULL)
                return NULL;
            /* SITES.capture itself: w->capture may be the sampled capture, which would draw
               again (the draw was made by capture_site) */
            res = PyObject_CallMethod(w->sites, "capture", "OiO", zero, limit, owner);
            Py_DECREF(zero);
            return res;
        }
        if (limit <= CACHE_FRAMES && PyLong_CheckExact(owner)) {
            int overflow = 0;
            owner_long = PyLong_AsLongAndOverflow(owner, &overflow);
            cacheable = !overflow && !(owner_long == -1 && PyErr_Occurred());
            PyErr_Clear();
        }
        if (cacheable) {
            /* the raw frames first: a hit needs nothing else */
            PyFrameObject *g = (PyFrameObject *)Py_NewRef(f);
            while (nframes < limit && g != NULL) {
                PyCodeObject *code = PyFrame_GetCode(g);
                PyFrameObject *back;
                codes[nframes] = (void *)code;
                Py_DECREF(code);
                lastis[nframes] = frame_lasti(g);
                nframes++;
                back = PyFrame_GetBack(g);
                Py_DECREF(g);
                g = back;
            }
            Py_XDECREF(g);
            slot = cache_slot(owner_long, nframes, codes, lastis);
            {
                SiteCacheEntry *e = &site_cache[slot];
                if (e->site != NULL && e->index == w->sites_index && e->owner == owner_long &&
                    e->n == nframes &&
                    memcmp(e->code, codes, sizeof(void *) * (size_t)nframes) == 0 &&
                    memcmp(e->lasti, lastis, sizeof(int) * (size_t)nframes) == 0)
                    return Py_NewRef(e->site);
            }
            key = PyTuple_New(1 + 2 * (Py_ssize_t)nframes);
            if (key == NULL)
                return NULL;
            PyTuple_SET_ITEM(key, 0, Py_NewRef(owner));
            for (i = 0; i < nframes; i++) {
                PyObject *c = PyLong_FromVoidPtr(codes[i]), *l;
                if (c == NULL) {
                    Py_DECREF(key);
                    return NULL;
                }
                PyTuple_SET_ITEM(key, 1 + 2 * i, c);
                l = PyLong_FromLong(lastis[i]);
                if (l == NULL) {
                    Py_DECREF(key);
                    return NULL;
                }
                PyTuple_SET_ITEM(key, 2 + 2 * i, l);
            }
            goto lookup;
        }
        if (limit > 64) {
            heap = PyMem_Malloc(sizeof(PyObject *) * (1 + 2 * (size_t)limit));
            if (heap == NULL)
                return PyErr_NoMemory();
            items = heap;
        }
        Py_INCREF(owner);
        items[n++] = owner;
        Py_INCREF(f);
        for (i = 0; i < limit && f != NULL; i++) {
            PyCodeObject *code = PyFrame_GetCode(f);
            int lasti = frame_lasti(f);
            items[n] = PyLong_FromVoidPtr(code);
            Py_DECREF(code);
            if (items[n] == NULL)
                goto fail;
            n++;
            items[n] = PyLong_FromLong(lasti);
            if (items[n] == NULL)
                goto fail;
            n++;
            {
                PyFrameObject *back = PyFrame_GetBack(f);
                Py_DECREF(f);
                f = back;
            }
        }
        Py_XDECREF(f);
        f = NULL;
        key = PyTuple_New(n);
        if (key == NULL)
            goto fail;
        for (i = 0; i < n; i++)
            PyTuple_SET_ITEM(key, i, items[i]);
        n = 0;
        if (heap)
            PyMem_Free(heap);
        heap = NULL;
    }
lookup:
    if (key == NULL)
        return NULL;
    site = PyDict_GetItemWithError(w->sites_index, key);
    if (site != NULL) {
        Py_INCREF(site);
        Py_DECREF(key);
        if (cacheable) {
            SiteCacheEntry *e = &site_cache[slot];
            Py_XSETREF(e->site, Py_NewRef(site));
            Py_XSETREF(e->index, Py_NewRef(w->sites_index));
            e->owner = owner_long;
            e->n = nframes;
            memcpy(e->code, codes, sizeof(void *) * (size_t)nframes);
            memcpy(e->lasti, lastis, sizeof(int) * (size_t)nframes);
        }
        return site;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    res = PyObject_CallMethod(w->sites, "_intern", "OiOO", zero, limit, owner, key);
    Py_DECREF(zero);
    Py_DECREF(key);
    return res;
fail:
    Py_XDECREF(f);
    for (i = 0; i < n; i++)
        Py_DECREF(items[i]);
    if (heap)
        PyMem_Free(heap);
    return NULL;
}

/* ``capture(1, depth, who) if depth or who else 0``, an Exception settled by contain(). */
static PyObject *
capture_site(Wrapper *w, PyObject *who)
{
    PyObject *site;
    int t;
    if (!w->depth) {
        t = truthy(who);
        if (t < 0)
            return NULL;
        if (!t)
            return PyLong_FromLong(0);
    }
    if (w->draw != Py_None) {
        /* stacks.sampled_capture, in C: ``capture(limit) if draw() < chance else (capture(0)
           if owner else 0)``, drawing from the same generator */
        PyObject *r = PyObject_CallNoArgs(w->draw);
        int lt = -1;
        if (r != NULL) {
            if (PyFloat_CheckExact(r) && PyFloat_CheckExact(w->chance))
                lt = PyFloat_AS_DOUBLE(r) < PyFloat_AS_DOUBLE(w->chance);
            else
                lt = PyObject_RichCompareBool(r, w->chance, Py_LT);
            Py_DECREF(r);
        }
        if (lt < 0)
            site = NULL;
        else if (lt)
            site = capture_native(w, w->depth, who);
        else {
            t = truthy(who);
            site = t < 0 ? NULL : t ? capture_native(w, 0, who) : PyLong_FromLong(0);
        }
    }
    else if (w->sites_index != Py_None)
        site = capture_native(w, w->depth, who);
    else
        site = PyObject_CallFunction(w->capture, "iiO", 0, w->depth, who);
    if (site == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL)
            PyException_SetTraceback(value, tb);
        site = PyObject_CallFunctionObjArgs(w->contain, w->guard, value ? value : Py_None, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    return site;
}

/* An Exception from the readers sends the call to the careful path; anything else rises. */
static int
swallow(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* Ledger.hot: the columns, the refcounted pool's uncertain set, the pool key, the holder
   column, the sparse maps of several-holder blocks and of leased blocks, and the context
   variable a call's holder is read from. Borrowed from the tuple, which the caller holds. */
typedef struct {
    PyObject *stamp, *origin, *freed, *ref, *uncertain, *pool, *holder, *holders, *leased,
             *holder_var;
} Hot;

static int
unpack_hot(PyObject *hot, Hot *h)
{
    if (!PyTuple_CheckExact(hot) || PyTuple_GET_SIZE(hot) != 12)
        return 0;
    h->stamp = PyTuple_GET_ITEM(hot, 0);
    h->origin = PyTuple_GET_ITEM(hot, 1);
    h->freed = PyTuple_GET_ITEM(hot, 2);
    h->ref = PyTuple_GET_ITEM(hot, 3);
    h->uncertain = PyTuple_GET_ITEM(hot, 4);
    h->pool = PyTuple_GET_ITEM(hot, 5);
    h->holder = PyTuple_GET_ITEM(hot, 6);
    h->holders = PyTuple_GET_ITEM(hot, 7);
    h->leased = PyTuple_GET_ITEM(hot, 8);
    h->holder_var = PyTuple_GET_ITEM(hot, 9);
    /* 10 and 11, the ledger's shared_by / released_by, are the closures' twins of
       holders_shared / holders_released below */
    if (!is_column(h->stamp, 'q') || !is_column(h->origin, 'I') || !is_column(h->freed, 'I')
        || !is_column(h->holder, 'I') || !PyDict_CheckExact(h->holders)
        || !PyDict_CheckExact(h->leased) || !PyContextVar_CheckExact(h->holder_var))
        return 0;
    if (h->ref == Py_None)
        h->ref = NULL;
    else if (!is_column(h->ref, 'i'))
        return 0;
    if (!PySet_CheckExact(h->uncertain))
        return 0;
    return 1;
}

/* The holder of this call (this thread's boundary slot, else ACTIVE_HOLDER's value) as a C
   integer: 0 for none; -1 with an error set. A value that is not a small exact int (never set so by kvguard) reads as "unknown": the
   call goes careful, where the ledger's own methods decide. */
static long long
holder_now(Hot *h, int *exact)
{
    return holder_in_force(h->holder_var, exact);
}

/* Whether block ``b`` is a key of the sparse map ``map`` (1, 0, or -1 with an error set). The
   key is made anew from the C value: nothing of the caller's list is read here. */
static int
in_map(PyObject *map, long long b)
{
    PyObject *key;
    int found;
    if (PyDict_GET_SIZE(map) == 0)
        return 0;
    key = PyLong_FromLongLong(b);
    if (key == NULL)
        return -1;
    found = PyDict_Contains(map, key);
    Py_DECREF(key);
    return found;
}

/* [owners] Whether the fast path may take a release (or, with ``share``, a share) of
   ``bids`` for ``holder``: a release of a block the holder does not hold (another holder holds
   it, alone or among several) goes careful, where it is named ``stale-free``. ``*mixed`` says
   the commit must then update the books of several holders: a block of several holders, or a
   live block another holder holds taken by a share. The holder column says which blocks have
   several (SEVERAL): only those are looked up in the map.
   1 yes, 0 no (careful path), -1 error. */
static int
holders_ok(Hot *h, const long long *bids, Py_ssize_t n, long long holder, int share, int *mixed)
{
    Py_ssize_t i;
    const uint32_t *held = (const uint32_t *)ARR(h->holder)->ob_item;
    const int64_t *stamp = (const int64_t *)ARR(h->stamp)->ob_item;
    Py_ssize_t hsize = Py_SIZE(h->holder), ssize = Py_SIZE(h->stamp);
    *mixed = 0;
    if (!holder && PyDict_GET_SIZE(h->holders) == 0)
        return 1;
    for (i = 0; i < n; i++) {
        long long b = bids[i];
        if (b >= hsize || b >= ssize)
            return 0;
        if (held[b] == SEVERAL) {
            if (holder && !share) {
                /* held while asked: an int key's hash and equality run no Python code,
                   but the reference costs nothing and survives any surprise */
                PyObject *key = PyLong_FromLongLong(b), *counts, *who;
                int found = 0;
                if (key == NULL)
                    return -1;
                counts = PyDict_GetItemWithError(h->holders, key);  /* borrowed */
                Py_DECREF(key);
                if (counts == NULL)
                    return PyErr_Occurred() ? -1 : 0;  /* not in the map: careful */
                if (!PyDict_CheckExact(counts))
                    return 0;
                who = PyLong_FromLongLong(holder);
                if (who == NULL)
                    return -1;
                Py_INCREF(counts);
                found = PyDict_Contains(counts, who);
                Py_DECREF(counts);
                Py_DECREF(who);
                if (found <= 0)
                    return found;
            }
            *mixed = 1;
        }
        else if (holder && held[b] != 0 && (long long)held[b] != holder) {
            if (!share)
                return 0;
            if (stamp[b] > 0)
                *mixed = 1;
        }
    }
    return 1;
}

/* counts[holder] += delta in one block's holder -> references map; a count that reaches 0 is
   removed. Int keys and values: no Python code runs here but the collector's. 0 or -1. */
static int
add_count(PyObject *counts, long long holder, long long delta)
{
    PyObject *who = PyLong_FromLongLong(holder), *old, *now;
    long long have = 0;
    int valid, rc = 0;
    if (who == NULL)
        return -1;
    old = PyDict_GetItemWithError(counts, who);  /* borrowed, read at once */
    if (old != NULL) {
        have = as_ll(old, &valid);
        if (!valid)
            have = 0;
    }
    else if (PyErr_Occurred())
        rc = -1;
    if (rc == 0) {
        have += delta;
        if (have > 0) {
            now = PyLong_FromLongLong(have);
            rc = now == NULL ? -1 : PyDict_SetItem(counts, who, now);
            Py_XDECREF(now);
        }
        else if (old != NULL)
            rc = PyDict_DelItem(counts, who);
    }
    Py_DECREF(who);
    return rc;
}

/* [owners] After a committed share of ``bids`` for ``holder`` (references already counted):
   a block of several holders counts one more reference of ``holder``; a live block another
   holder held alone becomes one (its earlier references that holder's). HolderBooks.shared_by,
   which the closures call, is the same. 0, or -1 with an error set. */
static int
holders_shared(Hot *h, const long long *bids, Py_ssize_t n, long long holder)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        long long b = bids[i], first, r;
        int rc = get_u32(h->holder, b, &first);
        PyObject *key, *counts;
        if (rc == 0 && first == SEVERAL) {
            key = PyLong_FromLongLong(b);
            if (key == NULL)
                return -1;
            counts = PyDict_GetItemWithError(h->holders, key);  /* borrowed */
            Py_DECREF(key);
            if (counts != NULL) {
                Py_INCREF(counts);
                if (PyDict_CheckExact(counts))
                    rc = add_count(counts, holder, 1);
                Py_DECREF(counts);
            }
            else if (PyErr_Occurred())
                rc = -1;
        }
        else if (rc == 0 && first && first != holder && h->ref != NULL
                 && (rc = get_i(h->ref, b, &r)) == 0) {
            /* {first: its references before this share, holder: 1} */
            PyObject *both = PyDict_New();
            rc = both == NULL || add_count(both, first, r - 1 > 1 ? r - 1 : 1) < 0
                 || add_count(both, holder, 1) < 0 ? -1 : 0;
            key = rc == 0 ? PyLong_FromLongLong(b) : NULL;
            rc = key == NULL ? -1 : PyDict_SetItem(h->holders, key, both);
            Py_XDECREF(both);
            Py_XDECREF(key);
            if (rc == 0)
                rc = set_u32(h->holder, b, SEVERAL, 1, NULL);
        }
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* [owners] After a committed release of ``bids`` by ``holder``: a block of several holders
   loses one of ``holder``'s references, and one left with a single holder goes back to the
   holder column; a block now free forgets its holders. HolderBooks.released_by, which the
   closures call, is the same. 0, or -1 with an error set. */
static int
holders_released(Hot *h, const long long *bids, Py_ssize_t n, long long holder)
{
    Py_ssize_t i;
    for (i = 0; i < n && PyDict_GET_SIZE(h->holders); i++) {
        long long b = bids[i], s, first;
        int rc;
        PyObject *key, *counts;
        if (get_u32(h->holder, b, &first) < 0)
            return -1;
        if (first != SEVERAL)
            continue;
        key = PyLong_FromLongLong(b);
        if (key == NULL)
            return -1;
        counts = PyDict_GetItemWithError(h->holders, key);  /* borrowed */
        if (counts == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        Py_INCREF(counts);
        rc = get_q(h->stamp, b, &s);
        if (rc == 0 && s <= 0) {  /* free now: it forgets its holders, this one the last */
            rc = PyDict_DelItem(h->holders, key);
            if (rc == 0)
                rc = set_u32(h->holder, b, holder, 1, NULL);
        }
        else if (rc == 0 && PyDict_CheckExact(counts)
                 && (rc = add_count(counts, holder, -1)) == 0 && PyDict_GET_SIZE(counts) <= 1) {
            Py_ssize_t pos = 0;
            PyObject *who, *refs;
            long long w = 0;
            int valid = 1;
            if (PyDict_Next(counts, &pos, &who, &refs))
                w = as_ll(who, &valid);
            /* back to the column: its one holder, or 0 (not known) */
            rc = PyDict_DelItem(h->holders, key);
            if (rc == 0)
                rc = set_u32(h->holder, b, valid && w < SEVERAL ? w : 0, 1, NULL);
        }
        Py_DECREF(counts);
        Py_DECREF(key);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static int
cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

#define DUP_TABLE 1024  /* calls of up to half this many ids are checked for repeats in a
                           table on the stack; more are sorted */

/* Every id an exact int in range whose stamp passes ``want`` (0: live, 1: not never-seen,
   2: free or unseen), none repeated. ids[] gets the values. */
static int
ids_ok(PyObject *list, Hot *h, int want, long long *ids)
{
    /* No Python code runs in here (as_ll reads exact ints only; PyMem_Malloc never collects):
       the list's length and the stamp column's size and items stay as read. */
    Py_ssize_t n = PyList_GET_SIZE(list), i, j;
    Py_ssize_t size = Py_SIZE(h->stamp);
    const int64_t *stamp = (const int64_t *)ARR(h->stamp)->ob_item;
    for (i = 0; i < n; i++) {
        int valid;
        long long b = as_ll(PyList_GET_ITEM(list, i), &valid);
        int64_t s;
        if (!valid || b < 0 || b >= size)
            return 0;
        s = stamp[b];
        if (want == 0 ? s <= 0 : want == 1 ? s == 0 : s > 0)
            return 0;
        ids[i] = b;
    }
    if (n <= 24) {
        for (i = 1; i < n; i++)
            for (j = 0; j < i; j++)
                if (ids[i] == ids[j])
                    return 0;
    }
    else if (n <= DUP_TABLE / 2) {
        /* a set of the ids (all >= 0 by now: -1 marks a free slot), open addressing */
        long long table[DUP_TABLE];
        unsigned int bits = 6;
        size_t mask, slot;
        while (((Py_ssize_t)1 << bits) < 2 * n)
            bits++;
        mask = ((size_t)1 << bits) - 1;
        memset(table, 0xFF, sizeof(long long) * (mask + 1));
        for (i = 0; i < n; i++) {
            slot = (size_t)(((uint64_t)ids[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));
            while (table[slot] >= 0) {
                if (table[slot] == ids[i])
                    return 0;
                slot = (slot + 1) & mask;
            }
            table[slot] = ids[i];
        }
    }
    else {
        long long *copy = PyMem_Malloc(sizeof(long long) * (size_t)n);
        int ok = 1;
        if (copy == NULL)
            return -1;
        memcpy(copy, ids, sizeof(long long) * (size_t)n);
        qsort(copy, (size_t)n, sizeof(long long), cmp_ll);
        for (i = 1; i < n; i++)
            if (copy[i] == copy[i - 1]) {
                ok = 0;
                break;
            }
        PyMem_Free(copy);
        return ok;
    }
    return 1;
}

/* fastread's kinds (fastread.OTHER, ARRAY, SCALAR) */
enum { K_OTHER = 0, K_ARRAY = 1, K_SCALAR = 2 };

static PyObject *s_ndim, *s_dtype, *s_kind, *s_tolist, *s_itemsize;

/* The start of numpy's ``PyArrayObject_fields`` (numpy/ndarraytypes.h, the same in numpy 1.x
   and 2.x; ``PyArray_NDIM`` and ``PyArray_DESCR`` read these fields): what ``ndim`` and
   ``dtype`` return. Never trusted unseen: np_layout_ok checks it on the first array a wrapper
   reads. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
} np_array_mirror;

#define NPA(o) ((np_array_mirror *)(o))

/* The last array type np_layout_ok was asked about (a strong reference, kept for the life of
   the module as array_type is) and its answer. */
static PyObject *layout_type = NULL;
static int layout_known = 0;

/* 1 if ``a``'s nd and descr fields are what ``a.ndim`` and ``a.dtype`` give (its ndim as a
   number, its dtype by identity), else 0; -1 with an error. */
static int
np_fields_match(PyObject *a)
{
    PyObject *ndim = PyObject_GetAttr(a, s_ndim), *dtype;
    int ok;
    if (ndim == NULL)
        return -1;
    dtype = PyObject_GetAttr(a, s_dtype);
    if (dtype == NULL) {
        Py_DECREF(ndim);
        return -1;
    }
    ok = PyLong_CheckExact(ndim) && PyLong_AsLong(ndim) == NPA(a)->nd && NPA(a)->descr == dtype;
    Py_DECREF(ndim);
    Py_DECREF(dtype);
    if (PyErr_Occurred())
        return -1;
    return ok;
}

/* Whether instances of ``type(value)``, numpy's array type, are laid out as np_array_mirror:
   ``value``, ``value[None]`` and ``value[None][None]`` (views of one, two more dimensions) must
   all be of that type, big enough, and have in those fields what ``ndim`` and ``dtype`` say:
   three different dimension counts at the same offset and the dtype's address at another
   cannot happen by chance. 0 (read them by name) on any doubt, errors cleared. */
static int
np_layout_ok(PyObject *value)
{
    PyTypeObject *tp = Py_TYPE(value);
    PyObject *views[3] = {value, NULL, NULL};
    int ok = 0, i;
    if (tp->tp_basicsize < (Py_ssize_t)sizeof(np_array_mirror))
        return 0;
    views[1] = PyObject_GetItem(value, Py_None);
    if (views[1] != NULL)
        views[2] = PyObject_GetItem(views[1], Py_None);
    if (views[2] != NULL) {
        ok = 1;
        for (i = 0; i < 3 && ok; i++)
            ok = Py_TYPE(views[i]) == tp && np_fields_match(views[i]) == 1 &&
                 NPA(views[i])->nd == NPA(value)->nd + i;
    }
    Py_XDECREF(views[1]);
    Py_XDECREF(views[2]);
    PyErr_Clear();
    return ok;
}

/* numpy integer scalars: numpy's Py<Type>ScalarObject (numpy/arrayscalars.h, the same in 1.x
   and 2.x) is the object header and then the value, ``obval``. A scalar type's reading, learned
   once per type by scalar_code and kept for the life of the module (a type's layout is fixed):
   the value's size in bytes (1, 2, 4 or 8), plus SCALAR_UNSIGNED; 0: read it as
   ``operator.index(value)``, as the careful path reads it. */
#define SCALAR_UNSIGNED 16
#define SCALAR_TYPES 16
static struct { PyObject *type; int code; } scalar_codes[SCALAR_TYPES];
static int scalar_codes_n = 0;

/* ``value``'s integer read from its bytes as ``code`` says: 1, or 0 where it does not fit a
   long long (a uint64 past int64: index(value) then reads it, and the ledger refuses it). */
static inline int
scalar_read(int code, PyObject *value, long long *out)
{
    const char *p = (const char *)value + sizeof(PyObject);
    switch (code) {
    case 1: { int8_t v; memcpy(&v, p, 1); *out = v; return 1; }
    case 2: { int16_t v; memcpy(&v, p, 2); *out = v; return 1; }
    case 4: { int32_t v; memcpy(&v, p, 4); *out = v; return 1; }
    case 8: { int64_t v; memcpy(&v, p, 8); *out = v; return 1; }
    case 1 | SCALAR_UNSIGNED: { uint8_t v; memcpy(&v, p, 1); *out = v; return 1; }
    case 2 | SCALAR_UNSIGNED: { uint16_t v; memcpy(&v, p, 2); *out = v; return 1; }
    case 4 | SCALAR_UNSIGNED: { uint32_t v; memcpy(&v, p, 4); *out = v; return 1; }
    case 8 | SCALAR_UNSIGNED: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)LLONG_MAX)
            return 0;
        *out = (long long)v;
        return 1;
    }
    }
    return 0;
}

/* 1 if reading ``value`` by ``code`` gives ``operator.index(value)``, 0 if not, -1 with an
   error. */
static int
scalar_read_agrees(int code, PyObject *value)
{
    long long v;
    int overflow;
    PyObject *b = PyNumber_Index(value);
    long long want;
    if (b == NULL)
        return -1;
    want = PyLong_AsLongLongAndOverflow(b, &overflow);
    Py_DECREF(b);
    if (want == -1 && PyErr_Occurred())
        return -1;
    return !overflow && scalar_read(code, value, &v) && v == want;
}

/* How ``value``'s type (numpy's, not a heap type) keeps its value: the code scalar_read
   takes, or 0. The dtype gives the size and signedness; the type must have room for them
   after the header; and the bytes there must read as ``index()`` reads ``value`` itself and
   four more instances made from 1, 100, a number that needs every byte, and -2 (signed) or
   the largest value (unsigned). Those cannot all agree by chance; 0 on any doubt (an error
   left set for scalar_code to weigh). */
static int
scalar_code_of(PyObject *value)
{
    PyTypeObject *tp = Py_TYPE(value);
    PyObject *dtype = NULL, *size = NULL, *kind = NULL;
    long itemsize;
    int code = 0, i;
    if ((tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || strncmp(tp->tp_name, "numpy.", 6) != 0)
        return 0;  /* numpy's own types only: nothing else is made to probe it */
    dtype = PyObject_GetAttr(value, s_dtype);
    if (dtype != NULL)
        size = PyObject_GetAttr(dtype, s_itemsize);
    if (size != NULL)
        kind = PyObject_GetAttr(dtype, s_kind);
    if (kind == NULL || !PyLong_CheckExact(size) || !PyUnicode_Check(kind))
        goto done;
    itemsize = PyLong_AsLong(size);
    if ((itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) ||
        tp->tp_basicsize < (Py_ssize_t)sizeof(PyObject) + itemsize)
        goto done;
    if (PyUnicode_CompareWithASCIIString(kind, "i") == 0)
        code = (int)itemsize;
    else if (PyUnicode_CompareWithASCIIString(kind, "u") == 0)
        code = (int)itemsize | SCALAR_UNSIGNED;
    else
        goto done;
    {
        unsigned long long top = itemsize == 8 ? ~0ull : (1ull << (8 * itemsize)) - 1;
        PyObject *probes[4] = {
            PyLong_FromLong(1), PyLong_FromLong(100),
            PyLong_FromUnsignedLongLong((1ull << (8 * itemsize - 2)) + 3),
            code & SCALAR_UNSIGNED ? PyLong_FromUnsignedLongLong(top) : PyLong_FromLong(-2)};
        int ok = probes[0] != NULL && probes[1] != NULL && probes[2] != NULL &&
                 probes[3] != NULL && scalar_read_agrees(code, value) == 1;
        for (i = 0; i < 4; i++) {
            PyObject *made = ok && probes[i] != NULL
                ? PyObject_CallOneArg((PyObject *)tp, probes[i]) : NULL;
            /* the largest uint64 does not fit a long long: it must read as "does not fit" */
            long long v;
            ok = made != NULL && Py_IS_TYPE(made, tp) &&
                 (code == (8 | SCALAR_UNSIGNED) && i == 3
                      ? !scalar_read(code, made, &v)
                      : scalar_read_agrees(code, made) == 1);
            Py_XDECREF(made);
        }
        for (i = 0; i < 4; i++)
            Py_XDECREF(probes[i]);
        if (!ok)
            code = 0;
    }
done:
    Py_XDECREF(dtype);
    Py_XDECREF(size);
    Py_XDECREF(kind);
    return PyErr_Occurred() ? 0 : code;
}

/* scalar_code_of for ``value``'s type, asked once per numpy type and remembered (not a heap
   type, which is never read in place; nothing remembered once the table is full, or when the
   answer was cut short). -1 with the error for one that is not an ``Exception`` (an
   interrupt) or a MemoryError: the wrapper meets it as any reader's error (an interrupt goes
   up; a MemoryError sends the call the careful way, as the closures' ``except Exception``).
   Learning runs numpy's code, which may re-enter a guard that learns a type too: the table is
   searched and its room checked again after. */
static int
scalar_code(PyObject *value)
{
    PyObject *tp = (PyObject *)Py_TYPE(value);
    int i, code, keep = 1;
    if ((Py_TYPE(value)->tp_flags & Py_TPFLAGS_HEAPTYPE) ||
        strncmp(Py_TYPE(value)->tp_name, "numpy.", 6) != 0)
        return 0;  /* read by index(), and not remembered: the table is for numpy's own */
    for (i = 0; i < scalar_codes_n; i++)
        if (scalar_codes[i].type == tp)
            return scalar_codes[i].code;
    if (scalar_codes_n >= SCALAR_TYPES)
        return 0;
    Py_INCREF(tp);
    code = scalar_code_of(value);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) {
            Py_DECREF(tp);
            return -1;
        }
        /* a numpy call refused what we asked: remember only the answers that cannot change */
        keep = PyErr_ExceptionMatches(PyExc_AttributeError) ||
               PyErr_ExceptionMatches(PyExc_TypeError) ||
               PyErr_ExceptionMatches(PyExc_ValueError) ||
               PyErr_ExceptionMatches(PyExc_OverflowError);
        PyErr_Clear();
        code = 0;
    }
    for (i = 0; i < scalar_codes_n; i++)  /* learned meanwhile by a re-entered guard */
        if (scalar_codes[i].type == tp)
            keep = 0;
    if (keep && scalar_codes_n < SCALAR_TYPES) {
        scalar_codes[scalar_codes_n].type = tp;  /* the reference taken above */
        scalar_codes[scalar_codes_n].code = code;
        scalar_codes_n++;
    }
    else
        Py_DECREF(tp);
    return code;
}

/* Plain ints for ids read out of numpy scalars, kept by the id's low bits and handed out again
   (an int is immutable, so sharing one is invisible), so a pool whose ids are numpy scalars
   does not pay an allocation and a release per id and call. A fixed few: 64 KiB at most. */
#define INT_CACHE 1024
static PyObject *int_cache[INT_CACHE];
static long long int_cache_value[INT_CACHE];

static inline PyObject *
cached_int(long long v)
{
    size_t slot = (size_t)v & (INT_CACHE - 1);
    PyObject *b = int_cache[slot];
    if (b != NULL && int_cache_value[slot] == v)
        return Py_NewRef(b);
    b = PyLong_FromLongLong(v);
    if (b == NULL)
        return NULL;
    int_cache_value[slot] = v;
    Py_XSETREF(int_cache[slot], Py_NewRef(b));
    return b;
}

/* The kind ``kinds`` gives ``value``'s type: K_ARRAY or K_SCALAR, K_OTHER (not numpy's, or
   not learned yet), -1 with an error. The last numpy type found is remembered (an entry of
   fastread's table never changes once learned), with, for an array type, its ``tolist``
   method descriptor when ``value.tolist`` can resolve to nothing else: a type that cannot be
   changed (not a heap type), with the generic attribute lookup and no instance __dict__; and
   for such a type whether its instances' ndim and dtype can be read in place (np_layout_ok,
   asked of this first array). */
static int
numpy_kind(Wrapper *w, PyObject *value)
{
    PyTypeObject *tp = Py_TYPE(value);
    PyObject *kind, *old_type, *old_tolist, *tolist = NULL;
    int layout = 0, scalar = 0;
    long k;
    if ((PyObject *)tp == w->np_type)
        return w->np_kind;
    kind = PyDict_GetItemWithError(w->kinds, (PyObject *)tp);
    if (kind == NULL)
        return PyErr_Occurred() ? -1 : K_OTHER;
    k = PyLong_CheckExact(kind) ? PyLong_AsLong(kind) : -1;
    if (k == -1 && PyErr_Occurred())
        PyErr_Clear();
    if (k != K_ARRAY && k != K_SCALAR)
        return K_OTHER;
    if (k == K_ARRAY && !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) &&
        tp->tp_getattro == PyObject_GenericGetAttr && tp->tp_dictoffset == 0) {
        tolist = PyObject_GetAttr((PyObject *)tp, s_tolist);
        if (tolist != NULL && !Py_IS_TYPE(tolist, &PyMethodDescr_Type))
            Py_CLEAR(tolist);
        PyErr_Clear();
        if ((PyObject *)tp != layout_type) {  /* asked once per type: a type's layout is fixed */
            int ok = np_layout_ok(value);
            Py_XSETREF(layout_type, Py_NewRef((PyObject *)tp));
            layout_known = ok;
        }
        layout = layout_known;
    }
    if (k == K_SCALAR) {
        scalar = scalar_code(value);
        if (scalar < 0) {
            Py_XDECREF(tolist);
            return -1;
        }
    }
    old_type = w->np_type;  /* the new entry is written whole, then the old one dropped */
    old_tolist = w->np_tolist;
    w->np_type = Py_NewRef((PyObject *)tp);
    w->np_tolist = tolist;
    w->np_kind = (int)k;
    w->np_layout = layout;
    w->np_scalar = scalar;
    Py_XDECREF(old_type);  /* last: the cache is whole before anything can run */
    Py_XDECREF(old_tolist);
    return (int)k;
}

/* ``[b]``, taking over the reference to ``b`` (NULL: the error stands). */
static inline PyObject *
one_id(PyObject *b)
{
    PyObject *one;
    if (b == NULL)
        return NULL;
    one = PyList_New(1);
    if (one == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    PyList_SET_ITEM(one, 0, b);
    return one;
}

/* fastread.plain_ids for a numpy array or scalar whose type fastread has learned: a new list,
   None (not ids the fast path takes), or NotImplemented (not learned: ask the Python reader).
   An array is read as ``value.tolist() if value.ndim == 1 and value.dtype.kind in "iu"``,
   ndim and dtype read in place where the layout was checked (np_layout_ok), else by name;
   nothing is converted unless it is 1-D (a block table passed by mistake costs nothing). */
static PyObject *
read_numpy(Wrapper *w, PyObject *value)
{
    int k = numpy_kind(w, value);
    if (k < 0)
        return NULL;
    if (k == K_ARRAY) {
        PyObject *dtype, *out;
        if (w->np_layout && (PyObject *)Py_TYPE(value) == w->np_type) {
            if (NPA(value)->nd != 1)
                Py_RETURN_NONE;
            dtype = Py_NewRef(NPA(value)->descr);
        }
        else {
            PyObject *ndim = PyObject_GetAttr(value, s_ndim);
            long nd;
            if (ndim == NULL)
                return NULL;
            if (!PyLong_CheckExact(ndim)) {  /* ``ndim == 1`` is Python's to answer */
                Py_DECREF(ndim);
                Py_RETURN_NOTIMPLEMENTED;
            }
            nd = PyLong_AsLong(ndim);
            Py_DECREF(ndim);
            if (nd == -1 && PyErr_Occurred())
                PyErr_Clear();  /* a huge ndim is not 1 */
            if (nd != 1)
                Py_RETURN_NONE;
            dtype = PyObject_GetAttr(value, s_dtype);
            if (dtype == NULL)
                return NULL;
        }
        if (dtype != w->int_dtype) {
            /* ``dtype.kind in "iu"``: one of "i", "u" (or "", "iu") */
            PyObject *dkind = PyObject_GetAttr(dtype, s_kind);
            int ok = 0;
            if (dkind == NULL) {
                Py_DECREF(dtype);
                return NULL;
            }
            if (!PyUnicode_Check(dkind)) {  /* not a str: let Python say what ``in`` does */
                Py_DECREF(dkind);
                Py_DECREF(dtype);
                Py_RETURN_NOTIMPLEMENTED;
            }
            if (PyUnicode_CompareWithASCIIString(dkind, "i") == 0 ||
                PyUnicode_CompareWithASCIIString(dkind, "u") == 0)
                ok = 2;  /* a kind worth remembering the dtype for */
            else if (PyUnicode_GET_LENGTH(dkind) == 0 ||
                     PyUnicode_CompareWithASCIIString(dkind, "iu") == 0)
                ok = 1;
            Py_DECREF(dkind);
            if (!ok) {
                Py_DECREF(dtype);
                Py_RETURN_NONE;
            }
            if (ok == 2)
                Py_XSETREF(w->int_dtype, Py_NewRef(dtype));
        }
        Py_DECREF(dtype);
        out = w->np_tolist != NULL && (PyObject *)Py_TYPE(value) == w->np_type
                  ? PyObject_Vectorcall(w->np_tolist, &value, 1, NULL)
                  : PyObject_CallMethodNoArgs(value, s_tolist);
        return out;  /* plain_ids returns what tolist() gives, or its error */
    }
    if (k == K_SCALAR) {
        long long v;
        if (w->np_scalar && scalar_read(w->np_scalar, value, &v))
            return one_id(cached_int(v));  /* what index(value) gives, read in place */
        return one_id(PyNumber_Index(value));
    }
    Py_RETURN_NOTIMPLEMENTED;  /* OTHER: the Python reader may still read a tensor */
}

/* fastread's reading of a list or tuple mixing plain ints and numpy integer scalars (ids
   taken out of an array one by one): a new list of ints, each scalar read in place as
   read_numpy reads one alone; NotImplemented (the Python reader answers, and learns what it
   has not seen) as soon as an item is anything else, or a scalar that cannot be read in place
   or does not fit an int64 (``array("q")`` refuses it there). */
static PyObject *
read_scalars(Wrapper *w, PyObject *value)
{
    Py_ssize_t i, n = PySequence_Fast_GET_SIZE(value);
    PyObject *out = PyList_New(n);  /* its items NULL until set: safe to drop part-filled */
    if (out == NULL)
        return NULL;
    /* [mutation] That allocation may have run the collector, and a finalizer the caller's
       list (a list may be cleared, leaving no item array at all, or grow): the length is
       read again, and a list that changed is the Python reader's, which reads it as it is
       now. Past this point only learning a type runs Python code (checked again below);
       cached_int makes ints, which the collector does not track, and drops one, which has no
       finalizer. */
    if (PySequence_Fast_GET_SIZE(value) != n) {
        Py_DECREF(out);
        Py_RETURN_NOTIMPLEMENTED;
    }
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(value, i), *b = NULL;
        long long v;
        if (PyLong_CheckExact(item)) {
            PyList_SET_ITEM(out, i, Py_NewRef(item));
            continue;
        }
        if ((PyObject *)Py_TYPE(item) != w->np_type) {  /* a type not read last time */
            /* [mutation] Learning a type may run code (numpy's; a metaclass's __hash__; the
               collector) that changes the list: the item is held, and read only if the list
               still holds it there, at the length read. */
            int k, same;
            Py_INCREF(item);
            k = numpy_kind(w, item);
            same = PySequence_Fast_GET_SIZE(value) == n &&
                   PySequence_Fast_GET_ITEM(value, i) == item;
            Py_DECREF(item);  /* the list holds it still, if same */
            if (k < 0) {
                Py_DECREF(out);
                return NULL;
            }
            if (!same) {
                Py_DECREF(out);
                Py_RETURN_NOTIMPLEMENTED;
            }
        }
        if ((PyObject *)Py_TYPE(item) == w->np_type && w->np_kind == K_SCALAR &&
            w->np_scalar && scalar_read(w->np_scalar, item, &v))
            b = cached_int(v);
        else {
            Py_DECREF(out);
            Py_RETURN_NOTIMPLEMENTED;
        }
        if (b == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, b);
    }
    return out;
}

/* kvguard.guard.readers.fast_reader's read_objects, for a spec with a plain ``id_attr``. */
static PyObject *
read_objects(Wrapper *w, PyObject *value)
{
    Py_ssize_t i;
    PyObject *out;
    if (!PyList_CheckExact(value) && !PyTuple_CheckExact(value))
        Py_RETURN_NONE;
    if (w->skip != Py_None) {
        if (PyTuple_CheckExact(w->keeps_all)) {
            /* keeps_all's identities: every item's attribute *is* the object paired with it */
            Py_ssize_t j, np = PyTuple_GET_SIZE(w->keeps_all);
            for (i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
                PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(value, i));
                for (j = 0; j < np; j++) {
                    PyObject *pair = PyTuple_GET_ITEM(w->keeps_all, j);
                    PyObject *got = j < SLOT_PAIRS
                        ? get_slot(&w->pair_slot[j], item, PyTuple_GET_ITEM(pair, 0))
                        : PyObject_GetAttr(item, PyTuple_GET_ITEM(pair, 0));
                    int same;
                    if (got == NULL) {
                        Py_DECREF(item);
                        return NULL;
                    }
                    same = got == PyTuple_GET_ITEM(pair, 1);
                    Py_DECREF(got);
                    if (!same) {
                        Py_DECREF(item);
                        Py_RETURN_NONE;
                    }
                }
                Py_DECREF(item);
            }
        }
        else if (w->keeps_all != Py_None) {
            PyObject *r = PyObject_CallFunctionObjArgs(w->keeps_all, w->allocator, value, NULL);
            int t;
            if (r == NULL)
                return NULL;
            t = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (t < 0)
                return NULL;
            if (!t)
                Py_RETURN_NONE;
        }
        else {
            /* any(map(skip, value)) */
            for (i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
                /* A reference of our own: skip() may run code that drops the list's. */
                PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(value, i));
                PyObject *r = PyObject_CallOneArg(w->skip, item);
                int t;
                Py_DECREF(item);
                if (r == NULL)
                    return NULL;
                t = PyObject_IsTrue(r);
                Py_DECREF(r);
                if (t < 0)
                    return NULL;
                if (t)
                    Py_RETURN_NONE;
            }
        }
    }
    /* list(map(attrgetter(id_attr), value)); a list the skip mutated is read as it is now */
    out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(value, i), *b;
        Py_INCREF(item);
        b = get_slot(&w->id_slot, item, w->id_attr);
        Py_DECREF(item);
        if (b == NULL || PyList_Append(out, b) < 0) {
            Py_XDECREF(b);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(b);
    }
    return out;
}

/* A new list of the call's ids, or None (careful path), or NULL with an error: what the spec's
   Python reader returns, read here for exact ints, lists/tuples of them, learned numpy types
   and block objects; the Python reader for everything else. */
static PyObject *
read_ids(Wrapper *w, PyObject *value)
{
    if (w->id_attr != Py_None)
        return read_objects(w, value);
    if (w->plain) {
        long long v;
        if (PyLong_CheckExact(value))
            return one_id(Py_NewRef(value));
        if ((PyObject *)Py_TYPE(value) == w->np_type && w->np_scalar &&
            scalar_read(w->np_scalar, value, &v))  /* read_numpy's scalar case, inline */
            return one_id(cached_int(v));
        if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
            Py_ssize_t i, n = PySequence_Fast_GET_SIZE(value);
            PyObject **items = PySequence_Fast_ITEMS(value);
            /* no Python code runs in this loop: n and items stay the list's */
            for (i = 0; i < n; i++)
                if (!PyLong_CheckExact(items[i]))
                    break;
            if (i == n)
                return PySequence_List(value);
            if (w->kinds != Py_None) {
                PyObject *r = read_scalars(w, value);
                if (r != Py_NotImplemented)
                    return r;
                Py_DECREF(r);
            }
        }
        else if (w->kinds != Py_None) {
            PyObject *r = read_numpy(w, value);
            if (r != Py_NotImplemented)
                return r;
            Py_DECREF(r);
        }
    }
    return PyObject_CallOneArg(w->read, value);
}

/* ``evidence.fold_empty(history, clock)`` on a history that is not a FlightRecorder (a deque):
   read and written through the sequence protocol, as the closures do. 0, or -1 with an error. */
static int
fold_into(Wrapper *w, PyObject *clock)
{
    PyObject *last = NULL, *entry = NULL, *count = NULL, *r;
    Py_ssize_t n = PyObject_Length(w->log);
    int rc = -1;
    if (n < 0)
        return -1;
    if (n > 0) {
        last = PySequence_GetItem(w->log, n - 1);
        if (last == NULL)
            return -1;
        if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == FIELDS &&
            folds_empty(PyTuple_GET_ITEM(last, 4), PyTuple_GET_ITEM(last, 1))) {
            count = PyNumber_Add(PyTuple_GET_ITEM(last, 1), s_one);
            entry = count == NULL ? NULL
                                  : PyTuple_Pack(FIELDS, clock, count, Py_None, Py_None, s_empty);
            rc = entry == NULL ? -1 : PySequence_SetItem(w->log, n - 1, entry);
            goto done;
        }
    }
    entry = PyTuple_Pack(FIELDS, clock, s_one, Py_None, Py_None, s_empty);
    if (entry == NULL)
        goto done;
    r = PyObject_CallOneArg(w->history, entry);
    if (r == NULL)
        goto done;
    Py_DECREF(r);
    rc = 0;
done:
    Py_XDECREF(last);
    Py_XDECREF(count);
    Py_XDECREF(entry);
    return rc;
}

/* What a fast call leaves behind once its ledger work is done, as the closures do it: the
   call and its blocks counted in ``Stats`` (``calls`` and ``blocks`` name the two counters),
   then one flight-recorder entry ``(clock, ids, site, pool, what)``, or a call with no ids
   folded into the newest entry (``evidence.fold_empty``). -1 with an error set. */
static int
record_call(Wrapper *w, PyObject *calls, PyObject *blocks, Py_ssize_t n, PyObject *clock,
            PyObject *ids, PyObject *site, PyObject *pool, PyObject *what)
{
    PyObject *entry, *r;
    if (stats_bump(w->stats, w->off_calls, calls, 1) < 0 ||
        stats_bump(w->stats, w->off_blocks, blocks, n) < 0)
        return -1;
    if (PyList_GET_SIZE(ids) == 0)  /* counted, not recorded: see recorder_fold */
        return w->recorder != NULL ? recorder_fold(w->recorder, clock)
                                   : w->history == Py_None ? 0 : fold_into(w, clock);
    if (w->recorder != NULL) {
        PyObject *fields[FIELDS] = {clock, ids, site, pool, what};
        return recorder_put(w->recorder, fields);
    }
    if (w->history == Py_None)
        return 0;
    entry = PyTuple_Pack(5, clock, ids, site, pool, what);
    if (entry == NULL)
        return -1;
    r = PyObject_CallOneArg(w->history, entry);
    Py_DECREF(entry);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

#define SMALL 32

/* ``tick()``. The guard's tick is ``itertools.count(...).__next__``: construction passes the
   count as tick_iter, whose tp_iternext is called straight (through the method-wrapper it
   costs several times more); otherwise tick is called. */
static PyObject *
next_tick(Wrapper *w)
{
    PyObject *self;
    if (w->tick_iter != NULL) {
        self = w->tick_iter;
        {
            PyObject *r = Py_TYPE(self)->tp_iternext(self);
            if (r == NULL && !PyErr_Occurred())
                PyErr_SetNone(PyExc_StopIteration);
            return r;
        }
    }
    return PyObject_CallNoArgs(w->tick);
}

/* --- release (free / share) under the lock ---------------------------------------------- */

static PyObject *
release_locked(Wrapper *w, Call *c)
{
    int share = w->kind == KIND_SHARE;
    PyObject *value = call_value(w, c);
    PyObject *drained = NULL, *ids = NULL, *hot = NULL, *held = NULL;
    PyObject *who = NULL, *site = NULL, *result = NULL, *clock = NULL, *negclock = NULL;
    PyObject *ret = NULL;
    long long small[SMALL], *bids = small, holder = 0;
    int mixed = 0;
    Hot h;
    Py_ssize_t n, n_called = 0, i;

    if (w->read != Py_None) {
        int one_shot = w->drain ? PySet_Contains(w->iterators, (PyObject *)Py_TYPE(value)) : 0;
        if (one_shot < 0)
            goto error;
        if (one_shot) {  /* read once, forward the list */
            drained = PySequence_List(value);
            if (drained == NULL)
                goto error;
            value = drained;
            if (call_put(w, c, drained) < 0)
                goto error;
        }
        /* try: ids, hot, held; except Exception: careful path */
        ids = read_ids(w, value);
        if (ids == NULL)
            goto read_failed;
        if (ids != Py_None && !PyList_CheckExact(ids)) {
            Py_CLEAR(ids);  /* a reader returns a list or None: anything else goes careful */
            goto careful;
        }
        if (ids == Py_None) {
            Py_CLEAR(ids);
            goto careful;
        }
        if (w->ledger_of == Py_None)
            hot = Py_NewRef(w->main);
        else {
            if (call_materialize(c) < 0)
                goto error;
            hot = PyObject_CallFunctionObjArgs(w->ledger_of, c->targs, c->tkw, NULL);
            if (hot == NULL)
                goto read_failed;
        }
        if (hot == Py_None)
            goto careful;
        if (w->engine_count != Py_None) {
            PyObject *it = PyObject_GetIter(value), *item;
            if (it == NULL)
                goto read_failed;
            held = PyList_New(0);
            if (held == NULL) {
                Py_DECREF(it);
                goto error;
            }
            while ((item = PyIter_Next(it)) != NULL) {
                PyObject *count = PyUnicode_CheckExact(w->engine_count)
                    ? get_slot(&w->count_slot, item, w->engine_count)  /* a plain name */
                    : PyObject_CallOneArg(w->engine_count, item);
                Py_DECREF(item);
                if (count == NULL || PyList_Append(held, count) < 0) {
                    Py_XDECREF(count);
                    Py_DECREF(it);
                    goto read_failed;
                }
                Py_DECREF(count);
            }
            Py_DECREF(it);
            if (PyErr_Occurred())
                goto read_failed;
        }
        if (!unpack_hot(hot, &h))
            goto careful;  /* not the ledger's columns: nothing here to trust */
        n = n_called = PyList_GET_SIZE(ids);
        if (n > SMALL) {
            bids = PyMem_Malloc(sizeof(long long) * (size_t)n);
            if (bids == NULL) {
                PyErr_NoMemory();
                goto error;
            }
        }
        {
            int ok = ids_ok(ids, &h, share ? 1 : 0, bids);
            if (ok < 0)
                goto error;
            if (!ok)
                goto careful;
        }
        if (held != NULL) {
            for (i = 0; i < PyList_GET_SIZE(held); i++) {
                int valid;
                long long cnt = as_ll(PyList_GET_ITEM(held, i), &valid);
                /* an engine count the ledger's int32 column cannot take (or none at all) is
                   settled per block by the careful path, never raised after the call */
                if (!valid || cnt <= 0 || cnt > INT32_MAX)
                    goto careful;
            }
        }
        {
            int exact, ok;
            holder = holder_now(&h, &exact);
            if (holder < 0)
                goto error;
            if (!exact)
                goto careful;
            ok = holders_ok(&h, bids, n, holder, share, &mixed);
            if (ok < 0)
                goto error;
            if (!ok)
                goto careful;
        }
        /* the fast path */
        if (share) {
            who = owner_now(w);
            if (who == NULL)
                goto error;
        }
        else
            who = PyLong_FromLong(0);
        if (who == NULL)
            goto error;
        site = capture_site(w, who);
        if (site == NULL)
            goto error;
        /* [mutation] Since the read, Python code may have run (the collector at any
           allocation above, and its finalizers): a caller's list that no longer has the
           length read goes the careful way, which reads it as it is now, so the ledger
           records what the allocator is given (as the closure checks). */
        if (PyList_CheckExact(value) && PyList_GET_SIZE(value) != n)
            goto careful;
        result = call_original(w, c);
        if (result == NULL)
            goto error;
        clock = next_tick(w);
        if (clock == NULL)
            goto error;
        {
            int cv, sv;
            long long cl = as_ll(clock, &cv), st = as_ll(site, &sv);
            if (cv && cl == LLONG_MIN)
                cv = 0;
            if (!cv || !PyLong_CheckExact(clock)) {
                cv = 0;
                negclock = PyNumber_Negative(clock);
                if (negclock == NULL)
                    goto error;
            }
            if (share) {
                for (i = 0; i < n; i++) {
                    long long s;
                    if (get_q(h.stamp, bids[i], &s) < 0)
                        goto error;
                    if (s <= 0) {
                        if (set_q(h.stamp, bids[i], cl, cv, clock) < 0 ||
                            set_u32(h.origin, bids[i], st, sv, site) < 0 ||
                            set_u32(h.holder, bids[i], holder, 1, NULL) < 0)
                            goto error;
                    }
                }
                if (h.ref != NULL) {
                    for (i = 0; i < n; i++) {
                        long long r;
                        if (get_i(h.ref, bids[i], &r) < 0 ||
                            set_i(h.ref, bids[i], r + 1, 1, NULL) < 0)
                            goto error;
                    }
                }
                /* holders' counts are bookkeeping for reports and the stale-free check,
                   never the allocator's state: an Exception there is swallowed */
                if (mixed && holder && holders_shared(&h, bids, n, holder) < 0
                    && swallow() < 0)
                    goto error;
                if (record_call(w, s_share_calls, s_blocks_shared, n, clock, ids, site, h.pool,
                                s_share) < 0)
                    goto error;
                ret = result;
                result = NULL;
                goto done;
            }
            if (h.ref == NULL) {
                for (i = 0; i < n; i++) {
                    if (set_q(h.stamp, bids[i], -cl, cv, negclock) < 0 ||
                        set_u32(h.freed, bids[i], st, sv, site) < 0)
                        goto error;
                }
            }
            else {
                Py_ssize_t dropped = 0;
                if (held != NULL) {
                    Py_ssize_t m = PyList_GET_SIZE(held);
                    for (i = 0; i < n && i < m; i++) {
                        PyObject *count = PyList_GET_ITEM(held, i);
                        long long r;
                        int valid;
                        long long cnt = as_ll(count, &valid);
                        if (get_i(h.ref, bids[i], &r) < 0)
                            goto error;
                        if (!valid || r != cnt) {
                            if (set_i(h.ref, bids[i], cnt, valid, count) < 0)
                                goto error;
                            if (PySet_GET_SIZE(h.uncertain)) {
                                PyObject *bo = PyList_GET_ITEM(ids, i);
                                if (PySet_Discard(h.uncertain, bo) < 0)
                                    goto error;
                            }
                        }
                    }
                }
                for (i = 0; i < n; i++) {
                    long long r;
                    if (get_i(h.ref, bids[i], &r) < 0)
                        goto error;
                    r -= 1;
                    if (set_i(h.ref, bids[i], r, 1, NULL) < 0)
                        goto error;
                    if (!r) {
                        if (set_q(h.stamp, bids[i], -cl, cv, negclock) < 0 ||
                            set_u32(h.freed, bids[i], st, sv, site) < 0)
                            goto error;
                        dropped++;
                    }
                }
                n = dropped;
            }
            if (holders_released(&h, bids, n_called, holder) < 0 && swallow() < 0)
                goto error;
            if (record_call(w, s_free_calls, s_blocks_freed, n, clock, ids, site, h.pool,
                            s_free) < 0)
                goto error;
            ret = result;
            result = NULL;
            goto done;
        }
    }
    goto careful;

read_failed:
    if (swallow() < 0)
        goto error;
careful:
    if (call_materialize(c) < 0)
        goto error;
    if (share)
        ret = PyObject_CallFunctionObjArgs(w->slow, w->guard, w->original, c->targs, c->tkw,
                                           NULL);
    else
        ret = PyObject_CallFunctionObjArgs(w->slow, w->guard, w->original, c->targs, c->tkw,
                                           value, NULL);
    goto done;
error:
    ret = NULL;
done:
    if (bids != small)
        PyMem_Free(bids);
    Py_XDECREF(drained);
    Py_XDECREF(ids);
    Py_XDECREF(hot);
    Py_XDECREF(held);
    Py_XDECREF(who);
    Py_XDECREF(site);
    Py_XDECREF(result);
    Py_XDECREF(clock);
    Py_XDECREF(negclock);
    return ret;
}

/* --- allocate under the lock -------------------------------------------------------------- */

static PyObject *
allocate_locked(Wrapper *w, Call *c)
{
    PyObject *result, *ids = NULL, *hot = NULL, *who = NULL, *site = NULL, *clock = NULL;
    PyObject *ret = NULL;
    long long small[SMALL], *bids = small, holder = 0;
    Hot h;
    Py_ssize_t n, i;

    result = call_original(w, c);
    if (result == NULL)
        return NULL;
    if (w->read != Py_None) {
        ids = read_ids(w, result);
        if (ids == NULL)
            goto read_failed;
        if (ids == Py_None || !PyList_CheckExact(ids)) {
            Py_CLEAR(ids);
            goto careful;
        }
        if (w->ledger_of == Py_None)
            hot = Py_NewRef(w->main);
        else {
            if (call_materialize(c) < 0)
                goto error;
            hot = PyObject_CallFunctionObjArgs(w->ledger_of, c->targs, c->tkw, NULL);
            if (hot == NULL)
                goto read_failed;
        }
        if (hot == Py_None || !unpack_hot(hot, &h))
            goto careful;
        n = PyList_GET_SIZE(ids);
        if (n > SMALL) {
            bids = PyMem_Malloc(sizeof(long long) * (size_t)n);
            if (bids == NULL) {
                PyErr_NoMemory();
                goto error;
            }
        }
        {
            int ok = ids_ok(ids, &h, 2, bids), exact;
            if (ok < 0)
                goto error;
            if (!ok)
                goto careful;
            /* [owners, leases] a block of several holders, or one an open lease covers:
               the careful path's (it clears the first, and names the second) */
            if (PyDict_GET_SIZE(h.holders) || PyDict_GET_SIZE(h.leased)) {
                for (i = 0; i < n; i++) {
                    long long first;
                    int b;
                    if (get_u32(h.holder, bids[i], &first) < 0)
                        goto error;
                    if (first == SEVERAL)
                        goto careful;
                    b = in_map(h.leased, bids[i]);
                    if (b < 0)
                        goto error;
                    if (b)
                        goto careful;
                }
            }
            holder = holder_now(&h, &exact);
            if (holder < 0)
                goto error;
            if (!exact)
                goto careful;
        }
        who = owner_now(w);
        if (who == NULL)
            goto error;
        site = capture_site(w, who);
        if (site == NULL)
            goto error;
        clock = next_tick(w);
        if (clock == NULL)
            goto error;
        {
            int cv, sv;
            long long cl = as_ll(clock, &cv), st = as_ll(site, &sv);
            for (i = 0; i < n; i++) {
                if (set_q(h.stamp, bids[i], cl, cv, clock) < 0 ||
                    set_u32(h.origin, bids[i], st, sv, site) < 0 ||
                    set_u32(h.holder, bids[i], holder, 1, NULL) < 0)
                    goto error;
            }
            if (h.ref != NULL) {
                for (i = 0; i < n; i++)
                    if (set_i(h.ref, bids[i], 1, 1, NULL) < 0)
                        goto error;
                if (PySet_GET_SIZE(h.uncertain)) {
                    for (i = 0; i < n; i++)
                        if (PySet_Discard(h.uncertain, PyList_GET_ITEM(ids, i)) < 0)
                            goto error;
                }
            }
        }
        if (record_call(w, s_alloc_calls, s_blocks_allocated, n, clock, ids, site, h.pool,
                        s_allocate) < 0)
            goto error;
        ret = result;
        result = NULL;
        goto done;
    }
    goto careful;

read_failed:
    if (swallow() < 0)
        goto error;
careful:
    if (call_materialize(c) < 0)
        goto error;
    ret = PyObject_CallFunctionObjArgs(w->slow, w->guard, w->capture, c->targs, c->tkw, result,
                                       NULL);
    goto done;
error:
    ret = NULL;
done:
    if (bids != small)
        PyMem_Free(bids);
    Py_XDECREF(result);
    Py_XDECREF(ids);
    Py_XDECREF(hot);
    Py_XDECREF(who);
    Py_XDECREF(site);
    Py_XDECREF(clock);
    return ret;
}

/* --- the call: pass-through when the lock is ours, else lock, work, unlock --------------- */

/* ``unlock()`` of the call's ``finally``: 0, or -1 with the error set. */
static int
unlock(Wrapper *w, unsigned long me)
{
    PyObject *r;
    if (w->glock != NULL)
        return glock_release(w->glock, me);
    r = PyObject_CallNoArgs(w->unlock);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
wrapper_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Wrapper *w = (Wrapper *)self;
    PyObject *r, *ret;
    Call c;
    int own;
    unsigned long me = 0;

    if (w->glock != NULL) {
        /* ``if owned(): pass through`` and ``acquire()``, inline */
        GuardLock *L = w->glock;
        me = PyThread_get_thread_ident();
        if (L->count == 0 && !L->reserved) {  /* free: taken (the GIL makes this atomic) */
            L->owner = me;
            L->count = 1;
        }
        else if (L->owner == me)  /* the allocator calling itself, or the guard forwarding */
            return PyObject_Vectorcall(w->original, args, nargsf, kwnames);
        else if (glock_wait(L, me, -1, 1) < 0)  /* another thread's: wait (1 or -1) */
            return NULL;
    }
    else {
        r = PyObject_CallNoArgs(w->owned);
        if (r == NULL)
            return NULL;
        own = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (own < 0)
            return NULL;
        if (own)  /* the allocator calling itself, or the guard forwarding */
            return PyObject_Vectorcall(w->original, args, nargsf, kwnames);
        r = PyObject_CallNoArgs(w->acquire);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }

    c.args = args;
    c.nargs = PyVectorcall_NARGS(nargsf);
    c.kwnames = (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) ? kwnames : NULL;
    c.targs = c.tkw = NULL;
    c.replaced = 0;
    c.stack = NULL;
    ret = w->kind == KIND_ALLOC ? allocate_locked(w, &c) : release_locked(w, &c);
    call_clear(&c);

    /* finally: unlock() (an exception on the way out stays the one raised) */
    if (ret == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (unlock(w, me) < 0) {
            /* As Python's ``finally``: the exception in flight becomes the new one's context. */
            PyObject *type2, *value2, *tb2;
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            PyErr_Fetch(&type2, &value2, &tb2);
            PyErr_NormalizeException(&type2, &value2, &tb2);
            if (value2 != NULL && value != NULL && value2 != value)
                PyException_SetContext(value2, value);  /* steals value */
            else
                Py_XDECREF(value);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyErr_Restore(type2, value2, tb2);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (unlock(w, me) < 0) {
        Py_DECREF(ret);
        return NULL;
    }
    return ret;
}

/* --- construction, GC, attributes ---------------------------------------------------------- */

static PyObject *
wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Wrapper *w;
    PyObject *guard, *original, *lock, *name, *dflt, *read, *main, *ledger_of, *put, *iterators,
        *stats, *history, *capture, *sites_index, *sites, *owner_var, *tick, *slow,
        *engine_count, *contain, *kinds, *id_attr, *skip, *keeps_all, *allocator, *tick_iter, *draw, *chance;
    Py_ssize_t pos;
    int kind, plain, drain, depth;

    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Wrapper() takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iOOOnOOOpOOpOOOOiOOOOOOOOOOOOOOOO:Wrapper", &kind, &guard, &original,
                          &lock, &pos, &name, &dflt, &read, &plain, &main, &ledger_of, &drain,
                          &put, &iterators, &stats, &history, &depth, &capture, &sites_index,
                          &sites, &owner_var, &tick, &slow, &engine_count, &contain,
                          &kinds, &id_attr, &skip, &keeps_all, &allocator, &tick_iter,
                          &draw, &chance))
        return NULL;
    if (kind < KIND_FREE || kind > KIND_ALLOC) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (free), 1 (share) or 2 (allocate)");
        return NULL;
    }
    if (!PyAnySet_Check(iterators)) {
        PyErr_SetString(PyExc_TypeError, "iterators must be a set of types");
        return NULL;
    }
    if (draw != Py_None && sites_index == Py_None) {
        PyErr_SetString(PyExc_TypeError, "a sampled capture (draw) needs sites_index");
        return NULL;
    }
    if (sites_index != Py_None && (!PyDict_Check(sites_index) || sites == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "sites_index must be a dict (with sites)");
        return NULL;
    }
    if ((kinds != Py_None && !PyDict_Check(kinds)) ||
        (id_attr != Py_None && !PyUnicode_Check(id_attr))) {
        PyErr_SetString(PyExc_TypeError, "kinds must be a dict or None, id_attr a str or None");
        return NULL;
    }
    if (PyTuple_CheckExact(keeps_all)) {  /* identities: read with PyTuple_GET_ITEM below */
        Py_ssize_t j;
        for (j = 0; j < PyTuple_GET_SIZE(keeps_all); j++) {
            PyObject *pair = PyTuple_GET_ITEM(keeps_all, j);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
                PyErr_SetString(PyExc_TypeError,
                                "keeps_all identities must be (str, object) pairs");
                return NULL;
            }
        }
    }
    if (name != Py_None && !PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "name must be a str or None");
        return NULL;
    }
    w = (Wrapper *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->vectorcall = wrapper_vectorcall;
    w->kind = kind;
    w->pos = pos;
    w->plain = plain;
    w->drain = drain;
    w->depth = depth;
    w->guard = Py_NewRef(guard);
    w->original = Py_NewRef(original);
    if (Py_IS_TYPE(lock, &GuardLock_Type))  /* exactly: a subclass may change what it does */
        w->glock = (GuardLock *)Py_NewRef(lock);
    else {
        w->owned = PyObject_GetAttrString(lock, "_is_owned");
        w->acquire = w->owned ? PyObject_GetAttrString(lock, "acquire") : NULL;
        w->unlock = w->acquire ? PyObject_GetAttrString(lock, "release") : NULL;
    }
    if (w->glock == NULL && w->unlock == NULL) {
        Py_DECREF(w);
        return NULL;
    }
    w->name = Py_NewRef(name);
    w->dflt = Py_NewRef(dflt);
    w->read = Py_NewRef(read);
    w->main = Py_NewRef(main);
    w->ledger_of = Py_NewRef(ledger_of);
    w->put = Py_NewRef(put);
    w->iterators = Py_NewRef(iterators);
    w->stats = Py_NewRef(stats);
    w->log = Py_NewRef(Py_None);
    if (Py_IS_TYPE(history, &Recorder_Type)) {  /* recorded into in place */
        w->recorder = (Recorder *)Py_NewRef(history);
        w->history = Py_NewRef(Py_None);
    }
    else {
        w->history = history == Py_None ? Py_NewRef(Py_None)
                                        : PyObject_GetAttrString(history, "append");
        Py_SETREF(w->log, Py_NewRef(history));
    }
    if (w->history == NULL) {  /* before anything else calls into Python */
        Py_DECREF(w);
        return NULL;
    }
    w->capture = Py_NewRef(capture);
    w->sites_index = Py_NewRef(sites_index);
    w->sites = Py_NewRef(sites);
    w->owner_var = Py_NewRef(owner_var);
    w->tick = Py_NewRef(tick);
    w->draw = Py_NewRef(draw);
    w->chance = Py_NewRef(chance);
    w->tick_iter = NULL;
    if (tick_iter != Py_None) {
        if (Py_TYPE(tick_iter)->tp_iternext == NULL) {
            Py_DECREF(w);
            PyErr_SetString(PyExc_TypeError, "tick_iter must be an iterator or None");
            return NULL;
        }
        w->tick_iter = Py_NewRef(tick_iter);
    }
    w->slow = Py_NewRef(slow);
    w->engine_count = Py_NewRef(engine_count);
    w->contain = Py_NewRef(contain);
    w->kinds = Py_NewRef(kinds);
    w->id_attr = Py_NewRef(id_attr);
    w->skip = Py_NewRef(skip);
    w->keeps_all = Py_NewRef(keeps_all);
    w->allocator = Py_NewRef(allocator);
    {
        PyObject *calls = kind == KIND_FREE ? s_free_calls : kind == KIND_SHARE ? s_share_calls
                                                                           : s_alloc_calls;
        PyObject *blocks = kind == KIND_FREE ? s_blocks_freed : kind == KIND_SHARE
                                                                    ? s_blocks_shared
                                                                    : s_blocks_allocated;
        w->off_calls = counter_place(stats, calls);
        w->off_blocks = counter_place(stats, blocks);
    }
    if (w->main != Py_None) {
        Hot h;
        if (!unpack_hot(w->main, &h)) {
            Py_DECREF(w);
            PyErr_SetString(PyExc_TypeError, "main must be a Ledger.hot tuple or None");
            return NULL;
        }
    }
    else if (w->ledger_of == Py_None && w->read != Py_None) {
        Py_DECREF(w);
        PyErr_SetString(PyExc_TypeError, "a reader needs main or ledger_of");
        return NULL;
    }
    return (PyObject *)w;
}

static int
wrapper_traverse(Wrapper *w, visitproc visit, void *arg)
{
    Py_VISIT(w->dict);
    Py_VISIT(w->guard);
    Py_VISIT(w->original);
    Py_VISIT(w->glock);
    Py_VISIT(w->owned);
    Py_VISIT(w->acquire);
    Py_VISIT(w->unlock);
    Py_VISIT(w->name);
    Py_VISIT(w->dflt);
    Py_VISIT(w->read);
    Py_VISIT(w->main);
    Py_VISIT(w->ledger_of);
    Py_VISIT(w->put);
    Py_VISIT(w->iterators);
    Py_VISIT(w->stats);
    Py_VISIT(w->history);
    Py_VISIT(w->log);
    Py_VISIT(w->recorder);
    Py_VISIT(w->capture);
    Py_VISIT(w->sites_index);
    Py_VISIT(w->sites);
    Py_VISIT(w->owner_var);
    Py_VISIT(w->tick);
    Py_VISIT(w->tick_iter);
    Py_VISIT(w->draw);
    Py_VISIT(w->chance);
    Py_VISIT(w->slow);
    Py_VISIT(w->engine_count);
    Py_VISIT(w->contain);
    Py_VISIT(w->kinds);
    Py_VISIT(w->np_type);
    Py_VISIT(w->int_dtype);
    Py_VISIT(w->np_tolist);
    Py_VISIT(w->id_slot.type);
    Py_VISIT(w->count_slot.type);
    for (int j = 0; j < SLOT_PAIRS; j++)
        Py_VISIT(w->pair_slot[j].type);
    Py_VISIT(w->id_attr);
    Py_VISIT(w->skip);
    Py_VISIT(w->keeps_all);
    Py_VISIT(w->allocator);
    return 0;
}

static int
wrapper_clear(Wrapper *w)
{
    Py_CLEAR(w->dict);
    Py_CLEAR(w->guard);
    Py_CLEAR(w->original);
    Py_CLEAR(w->glock);
    Py_CLEAR(w->owned);
    Py_CLEAR(w->acquire);
    Py_CLEAR(w->unlock);
    Py_CLEAR(w->name);
    Py_CLEAR(w->dflt);
    Py_CLEAR(w->read);
    Py_CLEAR(w->main);
    Py_CLEAR(w->ledger_of);
    Py_CLEAR(w->put);
    Py_CLEAR(w->iterators);
    Py_CLEAR(w->stats);
    Py_CLEAR(w->history);
    Py_CLEAR(w->log);
    Py_CLEAR(w->recorder);
    Py_CLEAR(w->capture);
    Py_CLEAR(w->sites_index);
    Py_CLEAR(w->sites);
    Py_CLEAR(w->owner_var);
    Py_CLEAR(w->tick);
    Py_CLEAR(w->tick_iter);
    Py_CLEAR(w->draw);
    Py_CLEAR(w->chance);
    Py_CLEAR(w->slow);
    Py_CLEAR(w->engine_count);
    Py_CLEAR(w->contain);
    Py_CLEAR(w->kinds);
    Py_CLEAR(w->np_type);
    Py_CLEAR(w->int_dtype);
    Py_CLEAR(w->np_tolist);
    Py_CLEAR(w->id_slot.type);
    Py_CLEAR(w->count_slot.type);
    for (int j = 0; j < SLOT_PAIRS; j++)
        Py_CLEAR(w->pair_slot[j].type);
    Py_CLEAR(w->id_attr);
    Py_CLEAR(w->skip);
    Py_CLEAR(w->keeps_all);
    Py_CLEAR(w->allocator);
    return 0;
}

static void
wrapper_dealloc(Wrapper *w)
{
    PyObject_GC_UnTrack(w);
    if (w->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)w);
    wrapper_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* Calls reach the wrapper through the allocator's instance __dict__: no binding wanted, as
   for the closures, which are looked up there too. */

static PyObject *
wrapper_self(PyObject *self, PyObject *Py_UNUSED(arg))
{
    return Py_NewRef(self);
}

static PyObject *
wrapper_reduce(PyObject *self, PyObject *Py_UNUSED(arg))
{
    PyErr_Format(PyExc_TypeError,
                 "cannot pickle %s: a guard's wrapper lives only on its allocator (the "
                 "allocator's own pickle leaves it out)", Py_TYPE(self)->tp_name);
    return NULL;
}

static PyMethodDef wrapper_methods[] = {
    /* like a function (the closures), copy and deepcopy give the wrapper itself */
    {"__copy__", wrapper_self, METH_NOARGS, NULL},
    {"__deepcopy__", wrapper_self, METH_O, NULL},
    {"__reduce__", wrapper_reduce, METH_NOARGS, NULL},
    {"__reduce_ex__", wrapper_reduce, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *
wrapper_repr(Wrapper *w)
{
    static const char *names[] = {"free", "share", "allocate"};
    return PyUnicode_FromFormat("<kvguard fast-path %s wrapper of %R>", names[w->kind],
                                w->original);
}

static PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject Wrapper_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvguard._fastpath.Wrapper",
    .tp_basicsize = sizeof(Wrapper),
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_vectorcall_offset = offsetof(Wrapper, vectorcall),
    .tp_repr = (reprfunc)wrapper_repr,
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A guarded allocator method: the fast path in C, the careful path in Python.",
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_clear = (inquiry)wrapper_clear,
    .tp_methods = wrapper_methods,
    .tp_getset = wrapper_getset,
    .tp_dictoffset = offsetof(Wrapper, dict),
    .tp_weaklistoffset = offsetof(Wrapper, weakreflist),
    .tp_new = wrapper_new,
};

/* --- module ---------------------------------------------------------------------------------- */

/* The array layout this file reads must be the one this interpreter has. */
static int
check_array_layout(PyObject *array_mod)
{
    struct { const char *code; const char *init; char tc; int size; long long first; } cases[] = {
        {"q", "(qq)", 'q', 8, 0}, {"I", NULL, 'I', 4, 0}, {"i", NULL, 'i', 4, 0},
    };
    PyObject *cls = PyObject_GetAttrString(array_mod, "array");
    size_t k;
    if (cls == NULL)
        return -1;
    if (!PyType_Check(cls)) {
        Py_DECREF(cls);
        PyErr_SetString(PyExc_ImportError, "array.array is not a type");
        return -1;
    }
    array_type = (PyTypeObject *)cls;  /* the module keeps it: one reference, never freed */
    for (k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        PyObject *arr = PyObject_CallFunction(cls, "s(iii)", cases[k].code, 7, 3, 5);
        Py_buffer view;
        int ok;
        if (arr == NULL)
            return -1;
        if (PyObject_GetBuffer(arr, &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(arr);
            return -1;
        }
        ok = Py_SIZE(arr) == 3 && view.buf == (void *)ARR(arr)->ob_item &&
             view.len == 3 * cases[k].size && ARR(arr)->ob_descr->typecode == cases[k].tc &&
             ARR(arr)->ob_descr->itemsize == cases[k].size;
        if (ok && cases[k].size == 8)
            ok = ((int64_t *)ARR(arr)->ob_item)[1] == 3;
        else if (ok)
            ok = ((int32_t *)ARR(arr)->ob_item)[2] == 5;
        PyBuffer_Release(&view);
        Py_DECREF(arr);
        if (!ok) {
            PyErr_SetString(PyExc_ImportError,
                            "kvguard._fastpath: array.array's layout is not the expected one");
            return -1;
        }
    }
    return 0;
}

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard._fastpath",
    .m_doc = "The guard's fast-path wrappers in C (optional; the closures are the reference).",
    .m_size = -1,
    .m_methods = fastpath_functions,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    PyObject *m, *array_mod;
    INTERN(s_free, "free");
    INTERN(s_share, "share");
    INTERN(s_allocate, "allocate");
    INTERN(s_empty, "empty");
    if ((s_one = PyLong_FromLong(1)) == NULL)
        return NULL;
    INTERN(s_free_calls, "free_calls");
    INTERN(s_blocks_freed, "blocks_freed");
    INTERN(s_share_calls, "share_calls");
    INTERN(s_blocks_shared, "blocks_shared");
    INTERN(s_alloc_calls, "alloc_calls");
    INTERN(s_blocks_allocated, "blocks_allocated");
    INTERN(s_ndim, "ndim");
    INTERN(s_dtype, "dtype");
    INTERN(s_kind, "kind");
    INTERN(s_tolist, "tolist");
    INTERN(s_itemsize, "itemsize");
    array_mod = PyImport_ImportModule("array");
    if (array_mod == NULL)
        return NULL;
    if (check_array_layout(array_mod) < 0) {
        Py_DECREF(array_mod);
        return NULL;
    }
    Py_DECREF(array_mod);
    m = PyModule_Create(&fastpath_module);
    if (m == NULL)
        return NULL;
    /* each type readied and added under the last part of its tp_name */
    if (PyModule_AddType(m, &Wrapper_Type) < 0 || PyModule_AddType(m, &GuardLock_Type) < 0 ||
        PyModule_AddType(m, &Counters_Type) < 0 || PyModule_AddType(m, &Recorder_Type) < 0 ||
        PyModule_AddType(m, &Holding_Type) < 0 || PyModule_AddType(m, &Boundary_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "FREE", KIND_FREE) < 0 ||
        PyModule_AddIntConstant(m, "SHARE", KIND_SHARE) < 0 ||
        PyModule_AddIntConstant(m, "ALLOCATE", KIND_ALLOC) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
