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
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

static int
is_column(PyObject *o, char code)
{
    return Py_TYPE(o) == array_type && ARR(o)->ob_descr->typecode == code;
}

/* Element access with the array's own behaviour outside the common case: an index past the
   column's present length, or a value the C type cannot hold, goes through the sequence
   protocol, which raises what ``column[b] = v`` raises in Python. */

static int
get_q(PyObject *col, Py_ssize_t b, long long *out)
{
    if (b < Py_SIZE(col) && is_column(col, 'q')) {
        *out = ((int64_t *)ARR(col)->ob_item)[b];
        return 0;
    }
    PyObject *v = PySequence_GetItem(col, b);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int
get_i(PyObject *col, Py_ssize_t b, long long *out)
{
    if (b < Py_SIZE(col) && is_column(col, 'i')) {
        *out = ((int32_t *)ARR(col)->ob_item)[b];
        return 0;
    }
    PyObject *v = PySequence_GetItem(col, b);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
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

/* --- the wrapper object ------------------------------------------------------------------- */

enum { KIND_FREE = 0, KIND_SHARE = 1, KIND_ALLOC = 2 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    int kind;
    PyObject *guard, *original, *owned, *acquire, *unlock;
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
    PyObject *history;       /* history.append, or None */
    int depth;
    PyObject *capture;       /* guard._capture */
    PyObject *sites_index;   /* SITES._index when capture is SITES.capture, else None */
    PyObject *sites;         /* SITES (its _intern is looked up on a miss, as Python does) */
    PyObject *owner_var;     /* ACTIVE_OWNER */
    PyObject *tick;
    PyObject *slow;          /* the Python trampoline to the careful path */
    PyObject *engine_count;  /* attrgetter(refcount_attr), or None */
    PyObject *contain;
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
            res = PyObject_CallFunction(w->capture, "OiO", zero, limit, owner);
            Py_DECREF(zero);
            return res;
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
            int lasti;
#if PY_VERSION_HEX >= 0x030B0000
            lasti = PyFrame_GetLasti(f);
#else
            lasti = f->f_lasti < 0 ? -1 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
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
    if (key == NULL)
        return NULL;
    site = PyDict_GetItemWithError(w->sites_index, key);
    if (site != NULL) {
        Py_INCREF(site);
        Py_DECREF(key);
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
    if (w->sites_index != Py_None)
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

typedef struct {
    PyObject *stamp, *origin, *freed, *ref, *uncertain, *pool;
} Hot;

static int
unpack_hot(PyObject *hot, Hot *h)
{
    if (!PyTuple_CheckExact(hot) || PyTuple_GET_SIZE(hot) != 6)
        return 0;
    h->stamp = PyTuple_GET_ITEM(hot, 0);
    h->origin = PyTuple_GET_ITEM(hot, 1);
    h->freed = PyTuple_GET_ITEM(hot, 2);
    h->ref = PyTuple_GET_ITEM(hot, 3);
    h->uncertain = PyTuple_GET_ITEM(hot, 4);
    h->pool = PyTuple_GET_ITEM(hot, 5);
    if (!is_column(h->stamp, 'q') || !is_column(h->origin, 'I') || !is_column(h->freed, 'I'))
        return 0;
    if (h->ref == Py_None)
        h->ref = NULL;
    else if (!is_column(h->ref, 'i'))
        return 0;
    if (!PySet_CheckExact(h->uncertain))
        return 0;
    return 1;
}

static int
cmp_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* Every id an exact int in range whose stamp passes ``want`` (0: live, 1: not never-seen,
   2: free or unseen), none repeated. ids[] gets the values. */
static int
ids_ok(PyObject *list, Hot *h, int want, long long *ids)
{
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

/* A new list of the call's ids, or None (careful path), or NULL with an error. Exact ints and
   lists/tuples of exact ints are read here when ``plain``; everything else by the reader. */
static PyObject *
read_ids(Wrapper *w, PyObject *value)
{
    if (w->plain) {
        if (PyLong_CheckExact(value))
        {
            PyObject *one = PyList_New(1);
            if (one != NULL)
                PyList_SET_ITEM(one, 0, Py_NewRef(value));
            return one;
        }
        if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
            Py_ssize_t i, n = PySequence_Fast_GET_SIZE(value);
            PyObject **items = PySequence_Fast_ITEMS(value);
            for (i = 0; i < n; i++)
                if (!PyLong_CheckExact(items[i]))
                    break;
            if (i == n)
                return PySequence_List(value);
        }
    }
    return PyObject_CallOneArg(w->read, value);
}

static PyObject *
append_history(Wrapper *w, PyObject *clock, PyObject *ids, PyObject *site, PyObject *pool,
               PyObject *what)
{
    PyObject *entry = PyTuple_Pack(5, clock, ids, site, pool, what), *r;
    if (entry == NULL)
        return NULL;
    r = PyObject_CallOneArg(w->history, entry);
    Py_DECREF(entry);
    return r;
}

#define SMALL 32

/* --- release (free / share) under the lock ---------------------------------------------- */

static PyObject *
release_locked(Wrapper *w, Call *c)
{
    int share = w->kind == KIND_SHARE;
    PyObject *value = call_value(w, c);
    PyObject *drained = NULL, *ids = NULL, *hot = NULL, *held = NULL;
    PyObject *who = NULL, *site = NULL, *result = NULL, *clock = NULL, *negclock = NULL;
    PyObject *ret = NULL;
    long long small[SMALL], *bids = small;
    Hot h;
    Py_ssize_t n, i;

    if (w->read != Py_None) {
        if (w->drain && value != NULL &&
            PySet_Contains(w->iterators, (PyObject *)Py_TYPE(value)) == 1) {
            PyObject *r;
            drained = PySequence_List(value);
            if (drained == NULL)
                goto error;
            value = drained;
            if (call_materialize(c) < 0)
                goto error;
            r = PyObject_CallFunctionObjArgs(w->put, c->targs, c->tkw, drained, NULL);
            if (r == NULL)
                goto error;
            if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
                Py_DECREF(r);
                PyErr_SetString(PyExc_TypeError, "put() must return (args, kwargs)");
                goto error;
            }
            Py_SETREF(c->targs, Py_NewRef(PyTuple_GET_ITEM(r, 0)));
            Py_SETREF(c->tkw, Py_NewRef(PyTuple_GET_ITEM(r, 1)));
            Py_DECREF(r);
            if (!PyTuple_Check(c->targs) || !PyDict_Check(c->tkw)) {
                PyErr_SetString(PyExc_TypeError, "put() must return (tuple, dict)");
                goto error;
            }
            c->replaced = 1;
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
                PyObject *count = PyObject_CallOneArg(w->engine_count, item);
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
        n = PyList_GET_SIZE(ids);
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
                if (!PyLong_CheckExact(PyList_GET_ITEM(held, i)) ||
                    (valid ? cnt <= 0 : cnt < 0))
                    goto careful;
            }
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
        result = call_original(w, c);
        if (result == NULL)
            goto error;
        clock = PyObject_CallNoArgs(w->tick);
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
                            set_u32(h.origin, bids[i], st, sv, site) < 0)
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
                if (stats_add(w->stats, s_share_calls, 1) < 0 ||
                    stats_add(w->stats, s_blocks_shared, n) < 0)
                    goto error;
                if (w->history != Py_None) {
                    PyObject *r = append_history(w, clock, ids, site, h.pool, s_share);
                    if (r == NULL)
                        goto error;
                    Py_DECREF(r);
                }
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
            if (stats_add(w->stats, s_free_calls, 1) < 0 ||
                stats_add(w->stats, s_blocks_freed, n) < 0)
                goto error;
            if (w->history != Py_None) {
                PyObject *r = append_history(w, clock, ids, site, h.pool, s_free);
                if (r == NULL)
                    goto error;
                Py_DECREF(r);
            }
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
    long long small[SMALL], *bids = small;
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
            int ok = ids_ok(ids, &h, 2, bids);
            if (ok < 0)
                goto error;
            if (!ok)
                goto careful;
        }
        who = owner_now(w);
        if (who == NULL)
            goto error;
        site = capture_site(w, who);
        if (site == NULL)
            goto error;
        clock = PyObject_CallNoArgs(w->tick);
        if (clock == NULL)
            goto error;
        {
            int cv, sv;
            long long cl = as_ll(clock, &cv), st = as_ll(site, &sv);
            for (i = 0; i < n; i++) {
                if (set_q(h.stamp, bids[i], cl, cv, clock) < 0 ||
                    set_u32(h.origin, bids[i], st, sv, site) < 0)
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
        if (stats_add(w->stats, s_alloc_calls, 1) < 0 ||
            stats_add(w->stats, s_blocks_allocated, n) < 0)
            goto error;
        if (w->history != Py_None) {
            PyObject *r = append_history(w, clock, ids, site, h.pool, s_allocate);
            if (r == NULL)
                goto error;
            Py_DECREF(r);
        }
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

static PyObject *
wrapper_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Wrapper *w = (Wrapper *)self;
    PyObject *r, *ret;
    Call c;
    int own;

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

    c.args = args;
    c.nargs = PyVectorcall_NARGS(nargsf);
    c.kwnames = (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) ? kwnames : NULL;
    c.targs = c.tkw = NULL;
    c.replaced = 0;
    ret = w->kind == KIND_ALLOC ? allocate_locked(w, &c) : release_locked(w, &c);
    call_clear(&c);

    /* finally: unlock() (an exception on the way out stays the one raised) */
    if (ret == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        r = PyObject_CallNoArgs(w->unlock);
        if (r == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(r);
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    r = PyObject_CallNoArgs(w->unlock);
    if (r == NULL) {
        Py_DECREF(ret);
        return NULL;
    }
    Py_DECREF(r);
    return ret;
}

/* --- construction, GC, attributes ---------------------------------------------------------- */

static PyObject *
wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Wrapper *w;
    PyObject *guard, *original, *lock, *name, *dflt, *read, *main, *ledger_of, *put, *iterators,
        *stats, *history, *capture, *sites_index, *sites, *owner_var, *tick, *slow,
        *engine_count, *contain;
    Py_ssize_t pos;
    int kind, plain, drain, depth;

    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Wrapper() takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iOOOnOOOpOOpOOOOiOOOOOOOO:Wrapper", &kind, &guard, &original,
                          &lock, &pos, &name, &dflt, &read, &plain, &main, &ledger_of, &drain,
                          &put, &iterators, &stats, &history, &depth, &capture, &sites_index,
                          &sites, &owner_var, &tick, &slow, &engine_count, &contain))
        return NULL;
    if (kind < KIND_FREE || kind > KIND_ALLOC) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (free), 1 (share) or 2 (allocate)");
        return NULL;
    }
    if (!PyAnySet_Check(iterators)) {
        PyErr_SetString(PyExc_TypeError, "iterators must be a set of types");
        return NULL;
    }
    if (sites_index != Py_None && (!PyDict_Check(sites_index) || sites == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "sites_index must be a dict (with sites)");
        return NULL;
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
    w->owned = PyObject_GetAttrString(lock, "_is_owned");
    w->acquire = PyObject_GetAttrString(lock, "acquire");
    w->unlock = PyObject_GetAttrString(lock, "release");
    w->name = Py_NewRef(name);
    w->dflt = Py_NewRef(dflt);
    w->read = Py_NewRef(read);
    w->main = Py_NewRef(main);
    w->ledger_of = Py_NewRef(ledger_of);
    w->put = Py_NewRef(put);
    w->iterators = Py_NewRef(iterators);
    w->stats = Py_NewRef(stats);
    w->history = history == Py_None ? Py_NewRef(Py_None) : PyObject_GetAttrString(history,
                                                                                   "append");
    w->capture = Py_NewRef(capture);
    w->sites_index = Py_NewRef(sites_index);
    w->sites = Py_NewRef(sites);
    w->owner_var = Py_NewRef(owner_var);
    w->tick = Py_NewRef(tick);
    w->slow = Py_NewRef(slow);
    w->engine_count = Py_NewRef(engine_count);
    w->contain = Py_NewRef(contain);
    if (w->owned == NULL || w->acquire == NULL || w->unlock == NULL || w->history == NULL) {
        Py_DECREF(w);
        return NULL;
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
    Py_VISIT(w->capture);
    Py_VISIT(w->sites_index);
    Py_VISIT(w->sites);
    Py_VISIT(w->owner_var);
    Py_VISIT(w->tick);
    Py_VISIT(w->slow);
    Py_VISIT(w->engine_count);
    Py_VISIT(w->contain);
    return 0;
}

static int
wrapper_clear(Wrapper *w)
{
    Py_CLEAR(w->dict);
    Py_CLEAR(w->guard);
    Py_CLEAR(w->original);
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
    Py_CLEAR(w->capture);
    Py_CLEAR(w->sites_index);
    Py_CLEAR(w->sites);
    Py_CLEAR(w->owner_var);
    Py_CLEAR(w->tick);
    Py_CLEAR(w->slow);
    Py_CLEAR(w->engine_count);
    Py_CLEAR(w->contain);
    return 0;
}

static void
wrapper_dealloc(Wrapper *w)
{
    PyObject_GC_UnTrack(w);
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
    INTERN(s_free_calls, "free_calls");
    INTERN(s_blocks_freed, "blocks_freed");
    INTERN(s_share_calls, "share_calls");
    INTERN(s_blocks_shared, "blocks_shared");
    INTERN(s_alloc_calls, "alloc_calls");
    INTERN(s_blocks_allocated, "blocks_allocated");
    array_mod = PyImport_ImportModule("array");
    if (array_mod == NULL)
        return NULL;
    if (check_array_layout(array_mod) < 0) {
        Py_DECREF(array_mod);
        return NULL;
    }
    Py_DECREF(array_mod);
    if (PyType_Ready(&Wrapper_Type) < 0)
        return NULL;
    m = PyModule_Create(&fastpath_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&Wrapper_Type);
    if (PyModule_AddObject(m, "Wrapper", (PyObject *)&Wrapper_Type) < 0) {
        Py_DECREF(&Wrapper_Type);
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
