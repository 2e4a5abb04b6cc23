/* kir.c: building kernel IR (hash-consed instructions with constant folding of
 * index arithmetic, typed bases, stores), the liveness, aliasing and stride
 * (affine coefficient) facts the renderers need, freeing modules, and a text
 * form of a module (rfi_kir_print, for tests and debugging).
 *
 * Deliberately no lowering (kir_lower.c) and no C (cpu/render_c.c) here.
 */
#include "kir.h"

#include <string.h>

/* ---- Kernels -------------------------------------------------------------------- */
rfi_kir_kernel *rfi_kir_kernel_new(int step)
{
    rfi_kir_kernel *k = rfi_calloc(1, sizeof *k);
    if (!k) {
        rfi_error(RF_E_NOMEM, "kir: out of memory for a kernel");
        return NULL;
    }
    k->step = step;
    k->red_value = -1;
    k->red_guard = -1;
    k->n_folds = 1;
    return k;
}

void rfi_kir_kernel_free(rfi_kir_kernel *k)
{
    if (!k)
        return;
    rfi_free(k->comment);
    rfi_free(k->bases);
    rfi_free(k->ins);
    rfi_free(k->stores);
    rfi_free(k->table);
    rfi_free(k);
}

/* A kernel that failed an allocation marks itself with a negative n_ins capacity. */
bool rfi_kir_failed(const rfi_kir_kernel *k)
{
    return k->cap_ins < 0;
}

static int fail(rfi_kir_kernel *k)
{
    k->cap_ins = -1;
    rfi_error(RF_E_NOMEM, "kir: out of memory building kernel of step %d", k->step);
    return -1;
}

/* ---- Hash-consing --------------------------------------------------------------------- */
static uint64_t ins_hash(const rfi_kir_ins *x)
{
    uint64_t h = RFI_HASH_INIT;
    int64_t f;
    memcpy(&f, &x->f, sizeof f);
    int64_t fields[] = {x->op, x->dtype, x->ir_op, x->cmp, x->a, x->b, x->c, x->var, x->base,
                        f, x->i};
    for (size_t j = 0; j < sizeof fields / sizeof fields[0]; j++)
        h = rfi_hash_u64(h, (uint64_t)fields[j]);
    return h;
}

static bool ins_equal(const rfi_kir_ins *x, const rfi_kir_ins *y)
{
    return x->op == y->op && x->dtype == y->dtype && x->ir_op == y->ir_op && x->cmp == y->cmp &&
           x->a == y->a && x->b == y->b && x->c == y->c && x->var == y->var &&
           x->base == y->base && memcmp(&x->f, &y->f, sizeof x->f) == 0 && x->i == y->i;
}

static bool table_rehash(rfi_kir_kernel *k)
{
    int ncap = k->table_cap ? k->table_cap * 2 : 256;
    int *t = rfi_calloc((size_t)ncap, sizeof(int));
    if (!t)
        return false;
    for (int id = 0; id < k->n_ins; id++) {
        uint64_t h = ins_hash(&k->ins[id]);
        size_t slot = (size_t)(h & (uint64_t)(ncap - 1));
        while (t[slot])
            slot = (slot + 1) & (size_t)(ncap - 1);
        t[slot] = id + 1;
    }
    rfi_free(k->table);
    k->table = t;
    k->table_cap = ncap;
    return true;
}

static int level_of(const rfi_kir_kernel *k, int id)
{
    return id >= 0 ? k->ins[id].level : 0;
}

/* ---- Value ranges of index instructions ------------------------------------------------ */
static bool range_known(const rfi_kir_ins *x)
{
    return x->lo != INT64_MIN || x->hi != INT64_MAX;
}

/* The extent of loop variable var, or 0 when not (yet) known. */
static int64_t var_extent(const rfi_kir_kernel *k, int var)
{
    if (var < 0)
        return 0;
    if (var < k->rank)
        return k->dims[var];
    return var - k->rank < k->red_rank ? k->red_dims[var - k->rank] : 0;
}

/* [lo, hi] of a op b from the operands' ranges (products of the corners). */
static void arith_range(rfi_kir_op op, const rfi_kir_ins *a, const rfi_kir_ins *b, int64_t *lo,
                        int64_t *hi)
{
    *lo = INT64_MIN;
    *hi = INT64_MAX;
    if (!range_known(a) || !range_known(b))
        return;
    int64_t c[4];
    switch (op) {
    case RFI_KIR_IADD:
        if (__builtin_add_overflow(a->lo, b->lo, lo) || __builtin_add_overflow(a->hi, b->hi, hi))
            *lo = INT64_MIN, *hi = INT64_MAX;
        return;
    case RFI_KIR_IMUL:
        if (__builtin_mul_overflow(a->lo, b->lo, &c[0]) ||
            __builtin_mul_overflow(a->lo, b->hi, &c[1]) ||
            __builtin_mul_overflow(a->hi, b->lo, &c[2]) ||
            __builtin_mul_overflow(a->hi, b->hi, &c[3]))
            return;
        *lo = *hi = c[0];
        for (int i = 1; i < 4; i++) {
            *lo = c[i] < *lo ? c[i] : *lo;
            *hi = c[i] > *hi ? c[i] : *hi;
        }
        return;
    case RFI_KIR_IDIV:
        if (b->lo == b->hi && b->lo > 0 && a->lo >= 0) {
            *lo = a->lo / b->lo;
            *hi = a->hi / b->lo;
        }
        return;
    case RFI_KIR_IREM:
        if (b->lo == b->hi && b->lo > 0 && a->lo >= 0) {
            *lo = a->hi < b->lo ? a->lo : 0;
            *hi = a->hi < b->lo ? a->hi : b->lo - 1;
        }
        return;
    case RFI_KIR_IMIN:
        *lo = a->lo < b->lo ? a->lo : b->lo;
        *hi = a->hi < b->hi ? a->hi : b->hi;
        return;
    case RFI_KIR_IMAX:
        *lo = a->lo > b->lo ? a->lo : b->lo;
        *hi = a->hi > b->hi ? a->hi : b->hi;
        return;
    default: return;
    }
}

static void set_range(const rfi_kir_kernel *k, rfi_kir_ins *x)
{
    x->lo = INT64_MIN;
    x->hi = INT64_MAX;
    switch (x->op) {
    case RFI_KIR_VAR: {
        int64_t n = var_extent(k, x->var);
        if (n > 0)
            x->lo = 0, x->hi = n - 1;
        break;
    }
    case RFI_KIR_CONST:
        if (!rfi_dtype_is_float(x->dtype))
            x->lo = x->hi = x->i;
        break;
    case RFI_KIR_IADD:
    case RFI_KIR_IMUL:
    case RFI_KIR_IDIV:
    case RFI_KIR_IREM:
    case RFI_KIR_IMIN:
    case RFI_KIR_IMAX: arith_range(x->op, &k->ins[x->a], &k->ins[x->b], &x->lo, &x->hi); break;
    default:
        if (x->dtype == RF_BOOL)
            x->lo = 0, x->hi = 1;
        break;
    }
}

/* The id of an instruction equal to *x, appending it if new. */
static int intern(rfi_kir_kernel *k, rfi_kir_ins x)
{
    if (rfi_kir_failed(k) || (x.op != RFI_KIR_VAR && x.op != RFI_KIR_CONST &&
                              x.op != RFI_KIR_ACC && x.a < 0) ||
        ((x.op == RFI_KIR_SELECT) && (x.b < 0 || x.c < 0)))
        return -1;
    if ((k->n_ins + 1) * 2 > k->table_cap && !table_rehash(k))
        return fail(k);
    uint64_t h = ins_hash(&x);
    size_t mask = (size_t)(k->table_cap - 1), slot = (size_t)(h & (uint64_t)mask);
    while (k->table[slot]) {
        int id = k->table[slot] - 1;
        if (ins_equal(&k->ins[id], &x)) {
            if (k->ins[id].node < 0)
                k->ins[id].node = x.node;
            return id;
        }
        slot = (slot + 1) & mask;
    }
    if (!rfi_grow((void **)&k->ins, k->n_ins, &k->cap_ins, sizeof x))
        return fail(k);
    switch (x.op) {
    case RFI_KIR_VAR: x.level = x.var < k->rank ? 1 : 2; break;
    case RFI_KIR_CONST: x.level = 0; break;
    case RFI_KIR_ACC: x.level = 3; break;
    default: {
        int l = level_of(k, x.a);
        if (level_of(k, x.b) > l)
            l = level_of(k, x.b);
        if (level_of(k, x.c) > l)
            l = level_of(k, x.c);
        x.level = l;
    }
    }
    set_range(k, &x);
    int id = k->n_ins++;
    k->ins[id] = x;
    k->table[slot] = id + 1;
    return id;
}

static rfi_kir_ins blank(rfi_kir_op op, rf_dtype dt)
{
    rfi_kir_ins x;
    memset(&x, 0, sizeof x);
    x.op = op;
    x.dtype = dt;
    x.a = x.b = x.c = -1;
    x.var = -1;
    x.base = -1;
    x.node = -1;
    return x;
}

bool rfi_kir_is_const(const rfi_kir_kernel *k, int id, int64_t *value)
{
    if (id < 0 || k->ins[id].op != RFI_KIR_CONST || rfi_dtype_is_float(k->ins[id].dtype))
        return false;
    *value = k->ins[id].i;
    return true;
}

/* ---- Affine coefficients ------------------------------------------------------------- */
/* rfi_kir_var_coef with a budget of instructions to visit (the operands form a
 * DAG walked without memo: the budget bounds the walk; exhausted means false). */
static bool var_coef(const rfi_kir_kernel *k, int id, int var, int64_t *coef, int *budget)
{
    const rfi_kir_ins *x = &k->ins[id];
    *coef = 0;
    if (x->op == RFI_KIR_VAR) {
        *coef = x->var == var;
        return true;
    }
    if (x->op == RFI_KIR_CONST || x->op == RFI_KIR_ACC || x->level == 0)
        return true;
    if (--*budget < 0)
        return false;
    int64_t c[3] = {0, 0, 0};
    int ops[3] = {x->a, x->b, x->c};
    for (int i = 0; i < 3; i++)
        if (ops[i] >= 0 && !var_coef(k, ops[i], var, &c[i], budget))
            return false;
    int64_t m;
    switch (x->op) {
    case RFI_KIR_IADD: *coef = c[0] + c[1]; return true;
    case RFI_KIR_IMUL:
        if (rfi_kir_is_const(k, x->b, &m))
            *coef = c[0] * m;
        else if (rfi_kir_is_const(k, x->a, &m))
            *coef = c[1] * m;
        else
            return c[0] == 0 && c[1] == 0;
        return true;
    default: return c[0] == 0 && c[1] == 0 && c[2] == 0; /* independent of var */
    }
}

bool rfi_kir_var_coef(const rfi_kir_kernel *k, int id, int var, int64_t *coef)
{
    int budget = 4096;
    return var_coef(k, id, var, coef, &budget);
}

/* ---- Emitters ------------------------------------------------------------------------ */
int rfi_kir_var(rfi_kir_kernel *k, int var)
{
    rfi_kir_ins x = blank(RFI_KIR_VAR, RF_I64);
    x.var = var;
    return intern(k, x);
}

int rfi_kir_const_i(rfi_kir_kernel *k, rf_dtype dt, int64_t v)
{
    if (rfi_dtype_is_float(dt))
        return rfi_kir_const_f(k, dt, (double)v);
    rfi_kir_ins x = blank(RFI_KIR_CONST, dt);
    x.i = dt == RF_BOOL ? v != 0 : v;
    return intern(k, x);
}

int rfi_kir_const_f(rfi_kir_kernel *k, rf_dtype dt, double v)
{
    rfi_kir_ins x = blank(RFI_KIR_CONST, dt);
    x.f = dt == RF_F32 ? (double)(float)v : v;
    return intern(k, x);
}

static int64_t fold_index(rfi_kir_op op, int64_t a, int64_t b)
{
    switch (op) {
    case RFI_KIR_IADD: return a + b;
    case RFI_KIR_IMUL: return a * b;
    case RFI_KIR_IDIV: return b ? a / b : 0;
    case RFI_KIR_IREM: return b ? a % b : 0;
    case RFI_KIR_IMIN: return a < b ? a : b;
    case RFI_KIR_IMAX: return a > b ? a : b;
    default: return 0;
    }
}

/* a / c and a % c (c > 0) when a's range or its form decides them without
 * the division, else -1. Exact under C's truncating division because every
 * rule requires the operands it splits to be >= 0:
 *   a in [0, c):                       a / c = 0,               a % c = a
 *   a = x*m (m a multiple of c):       a / c = x*(m/c),         a % c = 0
 *   a = x*m + y (x, y >= 0, m > 0 a multiple of c):
 *                                      a / c = x*(m/c) + y / c, a % c = y % c
 *   a = x*m + y (x >= 0, y in [0, m), c a multiple of m, q = c/m):
 *                                      a / c = x / q,  a % c = (x % q)*m + y
 * These are the index expressions of a transpose or reverse read through a
 * reshape (a row of 9 split into 3x3 again), or of a group's statistics read
 * per element of [N, C, H, W] (channel * HW + hw over a group of 4 channels),
 * which would otherwise cost a division per dim per element (and, in the
 * innermost loop, a gather per load of the group's value). */
static int split_division(rfi_kir_kernel *k, rfi_kir_op op, int a, int64_t c)
{
    const rfi_kir_ins *ra = &k->ins[a];
    if (range_known(ra) && ra->lo >= 0 && ra->hi < c)
        return op == RFI_KIR_IDIV ? rfi_kir_const_i(k, RF_I64, 0) : a;
    int64_t m = 0;
    if (ra->op == RFI_KIR_IMUL && rfi_kir_is_const(k, ra->b, &m) && m % c == 0) {
        int x = ra->a; /* read now: a new instruction may move k->ins, and ra with it */
        return op == RFI_KIR_IDIV
                   ? rfi_kir_index(k, RFI_KIR_IMUL, x, rfi_kir_const_i(k, RF_I64, m / c))
                   : rfi_kir_const_i(k, RF_I64, 0);
    }
    if (ra->op != RFI_KIR_IADD)
        return -1;
    for (int side = 0; side < 2; side++) {
        int mul = side ? ra->b : ra->a, rest = side ? ra->a : ra->b;
        const rfi_kir_ins *rm = &k->ins[mul], *rr = &k->ins[rest];
        if (rm->op != RFI_KIR_IMUL || !rfi_kir_is_const(k, rm->b, &m) || m <= 0)
            continue;
        const rfi_kir_ins *rx = &k->ins[rm->a];
        if (!range_known(rx) || rx->lo < 0 || !range_known(rr) || rr->lo < 0)
            continue;
        if (m % c != 0 && c % m == 0 && rr->hi < m) {
            /* a = x*m + y, y in [0, m), c = m*q: a / c = x / q, a % c = (x % q)*m + y */
            int x = rm->a, y = rest, q = rfi_kir_const_i(k, RF_I64, c / m);
            if (op == RFI_KIR_IDIV)
                return rfi_kir_index(k, RFI_KIR_IDIV, x, q);
            int rem = rfi_kir_index(k, RFI_KIR_IREM, x, q); /* made in this order on any compiler */
            int low = rfi_kir_index(k, RFI_KIR_IMUL, rem, rfi_kir_const_i(k, RF_I64, m));
            return rfi_kir_index(k, RFI_KIR_IADD, low, y);
        }
        if (m % c != 0)
            continue;
        int x = rm->a, cst = rfi_kir_const_i(k, RF_I64, c);
        if (op == RFI_KIR_IREM)
            return rfi_kir_index(k, RFI_KIR_IREM, rest, cst);
        int hi_part = rfi_kir_index(k, RFI_KIR_IMUL, x, rfi_kir_const_i(k, RF_I64, m / c));
        return rfi_kir_index(k, RFI_KIR_IADD, hi_part, rfi_kir_index(k, RFI_KIR_IDIV, rest, cst));
    }
    return -1;
}

int rfi_kir_index(rfi_kir_kernel *k, rfi_kir_op op, int a, int b)
{
    if (a < 0 || b < 0)
        return -1;
    int64_t ca = 0, cb = 0;
    bool ka = rfi_kir_is_const(k, a, &ca), kb = rfi_kir_is_const(k, b, &cb);
    if (ka && kb)
        return rfi_kir_const_i(k, RF_I64, fold_index(op, ca, cb));
    bool commutes = op == RFI_KIR_IADD || op == RFI_KIR_IMUL || op == RFI_KIR_IMIN ||
                    op == RFI_KIR_IMAX;
    if (commutes && (ka || (!kb && a > b))) { /* constants second, then by id */
        int t = a; a = b; b = t;
        int64_t tc = ca; ca = cb; cb = tc;
        bool tk = ka; ka = kb; kb = tk;
    }
    int64_t cinner = 0;
    if (op == RFI_KIR_IADD && kb && k->ins[a].op == RFI_KIR_IADD &&
        rfi_kir_is_const(k, k->ins[a].b, &cinner)) /* (x + c1) + c2 = x + (c1 + c2) */
        return rfi_kir_index(k, RFI_KIR_IADD, k->ins[a].a,
                             rfi_kir_const_i(k, RF_I64, cinner + cb));
    /* (x + c) + y = (x + y) + c for x >= 0: a constant offset ends outermost,
     * where rfi_kir_rebase takes it into the base (a slice of each row at its
     * own column, i + c + row * stride, then shares one function). Not for an
     * x that may be negative: 8 - i stays a part in [0, 9) that a division by
     * 9 can split off (split_division). */
    for (int side = 0; op == RFI_KIR_IADD && !kb && side < 2; side++) {
        int inner = side ? b : a, other = side ? a : b;
        int x = k->ins[inner].a, c = k->ins[inner].b; /* copied: interning may move ins */
        if (k->ins[inner].op == RFI_KIR_IADD && rfi_kir_is_const(k, c, &cinner) &&
            range_known(&k->ins[x]) && k->ins[x].lo >= 0) {
            int sum = rfi_kir_index(k, RFI_KIR_IADD, x, other);
            return rfi_kir_index(k, RFI_KIR_IADD, sum, c);
        }
    }
    if (kb) {
        if ((op == RFI_KIR_IADD && cb == 0) || (op == RFI_KIR_IMUL && cb == 1) ||
            (op == RFI_KIR_IDIV && cb == 1))
            return a;
        if ((op == RFI_KIR_IMUL && cb == 0) || (op == RFI_KIR_IREM && cb == 1))
            return rfi_kir_const_i(k, RF_I64, 0);
    }
    if (ka && ca == 0 && (op == RFI_KIR_IDIV || op == RFI_KIR_IREM))
        return a;
    if (kb && cb > 0 && (op == RFI_KIR_IDIV || op == RFI_KIR_IREM)) {
        int split = split_division(k, op, a, cb);
        if (split >= 0)
            return split;
    }
    if (a == b && (op == RFI_KIR_IMIN || op == RFI_KIR_IMAX))
        return a;
    const rfi_kir_ins *ra = &k->ins[a], *rb = &k->ins[b];
    if (range_known(ra) && range_known(rb)) { /* min/max the ranges decide */
        if (op == RFI_KIR_IMIN && (ra->hi <= rb->lo || rb->hi <= ra->lo))
            return ra->hi <= rb->lo ? a : b;
        if (op == RFI_KIR_IMAX && (ra->lo >= rb->hi || rb->lo >= ra->hi))
            return ra->lo >= rb->hi ? a : b;
    }
    rfi_kir_ins x = blank(op, RF_I64);
    x.a = a;
    x.b = b;
    return intern(k, x);
}

static bool cmp_holds(rf_cmp cmp, int64_t a, int64_t b)
{
    switch (cmp) {
    case RF_EQ: return a == b;
    case RF_NE: return a != b;
    case RF_LT: return a < b;
    case RF_LE: return a <= b;
    case RF_GT: return a > b;
    case RF_GE: return a >= b;
    default: return false;
    }
}

/* 1 or 0 when a cmp b holds or fails for every value in the ranges, else -1. */
static int icmp_by_range(rf_cmp cmp, const rfi_kir_ins *a, const rfi_kir_ins *b)
{
    if (!range_known(a) || !range_known(b))
        return -1;
    bool lt = a->hi < b->lo, gt = a->lo > b->hi, le = a->hi <= b->lo, ge = a->lo >= b->hi;
    switch (cmp) {
    case RF_LT: return lt ? 1 : ge ? 0 : -1;
    case RF_LE: return le ? 1 : gt ? 0 : -1;
    case RF_GT: return gt ? 1 : le ? 0 : -1;
    case RF_GE: return ge ? 1 : lt ? 0 : -1;
    case RF_EQ: return (lt || gt) ? 0 : -1;
    case RF_NE: return (lt || gt) ? 1 : -1;
    default: return -1;
    }
}

int rfi_kir_icmp(rfi_kir_kernel *k, rf_cmp cmp, int a, int b)
{
    if (a < 0 || b < 0)
        return -1;
    int64_t ca, cb;
    if (rfi_kir_is_const(k, a, &ca) && rfi_kir_is_const(k, b, &cb))
        return rfi_kir_const_i(k, RF_BOOL, cmp_holds(cmp, ca, cb));
    int decided = icmp_by_range(cmp, &k->ins[a], &k->ins[b]);
    if (decided >= 0)
        return rfi_kir_const_i(k, RF_BOOL, decided);
    rfi_kir_ins x = blank(RFI_KIR_ICMP, RF_BOOL);
    x.cmp = cmp;
    x.a = a;
    x.b = b;
    return intern(k, x);
}

int rfi_kir_land(rfi_kir_kernel *k, int a, int b)
{
    if (a < 0 || b < 0)
        return -1;
    int64_t c;
    if (rfi_kir_is_const(k, a, &c))
        return c ? b : a;
    if (rfi_kir_is_const(k, b, &c))
        return c ? a : b;
    if (a == b)
        return a;
    rfi_kir_ins x = blank(RFI_KIR_LAND, RF_BOOL);
    x.a = a < b ? a : b;
    x.b = a < b ? b : a;
    return intern(k, x);
}

int rfi_kir_load(rfi_kir_kernel *k, int base, int index, int node)
{
    rfi_kir_ins x = blank(RFI_KIR_LOAD, base >= 0 ? k->bases[base].dtype : RF_F32);
    x.base = base;
    x.a = index;
    x.node = node;
    return base >= 0 ? intern(k, x) : -1;
}

int rfi_kir_unary(rfi_kir_kernel *k, rfi_op op, rf_dtype dt, int a, int node)
{
    rfi_kir_ins x = blank(RFI_KIR_UNARY, dt);
    x.ir_op = op;
    x.a = a;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_binary(rfi_kir_kernel *k, rfi_op op, rf_dtype dt, int a, int b, int node)
{
    if (b < 0)
        return -1;
    rfi_kir_ins x = blank(RFI_KIR_BINARY, dt);
    x.ir_op = op;
    x.a = a;
    x.b = b;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_compare(rfi_kir_kernel *k, rf_cmp cmp, int a, int b, int node)
{
    if (b < 0)
        return -1;
    rfi_kir_ins x = blank(RFI_KIR_COMPARE, RF_BOOL);
    x.cmp = cmp;
    x.a = a;
    x.b = b;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_select(rfi_kir_kernel *k, int pred, int a, int b, int node)
{
    if (pred < 0 || a < 0 || b < 0)
        return -1;
    int64_t c;
    if (rfi_kir_is_const(k, pred, &c))
        return c ? a : b;
    if (a == b)
        return a;
    rfi_kir_ins x = blank(RFI_KIR_SELECT, k->ins[a].dtype);
    x.a = pred;
    x.b = a;
    x.c = b;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_convert(rfi_kir_kernel *k, rf_dtype dt, int a, int node)
{
    if (a < 0)
        return -1;
    if (k->ins[a].dtype == dt)
        return a;
    rfi_kir_ins x = blank(RFI_KIR_CONVERT, dt);
    x.a = a;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_round_bf16(rfi_kir_kernel *k, int a, int node)
{
    if (a < 0)
        return -1;
    const rfi_kir_ins *v = &k->ins[a];
    if (v->op == RFI_KIR_CONST)
        return rfi_kir_const_f(k, RF_F32, rfi_round_bf16((float)v->f));
    if (v->op == RFI_KIR_ROUND_BF16)
        return a; /* rounding twice rounds once */
    rfi_kir_ins x = blank(RFI_KIR_ROUND_BF16, RF_F32);
    x.a = a;
    x.node = node;
    return intern(k, x);
}

int rfi_kir_acc_of(rfi_kir_kernel *k, int fold)
{
    rfi_kir_ins x = blank(RFI_KIR_ACC, k->acc_dtype);
    x.i = fold;
    return intern(k, x);
}

int rfi_kir_base_get(rfi_kir_kernel *k, int buffer, size_t offset, rf_dtype dt, size_t nbytes,
                     bool written, int node)
{
    if (rfi_kir_failed(k))
        return -1;
    for (int b = 0; b < k->n_bases; b++) {
        rfi_kir_base *x = &k->bases[b];
        if (x->buffer == buffer && x->offset == offset && x->dtype == dt) {
            if (nbytes > x->nbytes)
                x->nbytes = nbytes;
            x->written |= written;
            return b;
        }
    }
    if (!rfi_grow((void **)&k->bases, k->n_bases, &k->cap_bases, sizeof(rfi_kir_base)))
        return fail(k);
    rfi_kir_base *x = &k->bases[k->n_bases];
    x->buffer = buffer;
    x->offset = offset;
    x->nbytes = nbytes;
    x->dtype = dt;
    x->written = written;
    x->noalias = true;
    x->node = node;
    return k->n_bases++;
}

rf_status rfi_kir_add_store(rfi_kir_kernel *k, int base, int index, int value, int node)
{
    if (rfi_kir_failed(k) || base < 0 || index < 0 || value < 0)
        return rfi_kir_failed(k) ? RF_E_NOMEM : rfi_error(RF_E_INTERNAL,
                                                          "kir: step %d: incomplete store of %%%d",
                                                          k->step, node);
    if (!rfi_grow((void **)&k->stores, k->n_stores, &k->cap_stores, sizeof(rfi_kir_store))) {
        fail(k);
        return RF_E_NOMEM;
    }
    rfi_kir_store s = {base, index, value, node};
    k->stores[k->n_stores++] = s;
    return RF_OK;
}

void rfi_kir_mark_aliasing(rfi_kir_kernel *k)
{
    for (int i = 0; i < k->n_bases; i++) {
        rfi_kir_base *x = &k->bases[i];
        x->noalias = true;
        for (int j = 0; j < k->n_bases; j++) {
            const rfi_kir_base *y = &k->bases[j];
            if (i == j || x->buffer != y->buffer)
                continue;
            bool overlap = x->offset < y->offset + y->nbytes && y->offset < x->offset + x->nbytes;
            if (overlap && (x->written || y->written))
                x->noalias = false;
        }
    }
}

/* ---- Rebasing constant offsets -------------------------------------------------------- *
 * A base that every live load and store indexes as x + c, with one constant
 * c > 0, moves c elements up and is indexed by x: the same addresses. The
 * pieces of a segmented update (each parameter's Adam step, reading its
 * moments in flat vectors at its own offset) then differ in their pointers
 * only, and the renderer can give them one function (render_c.c). */

/* The constant c of an index x + c (constants come second: rfi_kir_index)
 * with x >= 0, so that the moved base still starts at the lowest byte read
 * (rfi_kir_mark_aliasing compares byte ranges). */
static bool offset_index(const rfi_kir_kernel *k, int id, int64_t *c)
{
    const rfi_kir_ins *x = &k->ins[id];
    return x->op == RFI_KIR_IADD && rfi_kir_is_const(k, x->b, c) &&
           range_known(&k->ins[x->a]) && k->ins[x->a].lo >= 0;
}

/* The offset every live access to base b shares (0: none to take out). */
static int64_t shared_offset(const rfi_kir_kernel *k, const bool *live, int b)
{
    int64_t shared = 0, c;
    bool seen = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->op != RFI_KIR_LOAD || x->base != b)
            continue;
        if (!offset_index(k, x->a, &c) || (seen && c != shared))
            return 0;
        shared = c, seen = true;
    }
    for (int s = 0; s < k->n_stores; s++) {
        if (k->stores[s].base != b)
            continue;
        if (!offset_index(k, k->stores[s].index, &c) || (seen && c != shared))
            return 0;
        shared = c, seen = true;
    }
    return shared > 0 ? shared : 0;
}

rf_status rfi_kir_rebase(rfi_kir_kernel *k)
{
    bool *live = rfi_malloc(((size_t)k->n_ins + 1) * sizeof *live);
    if (!live)
        return rfi_error(RF_E_NOMEM, "kir: out of memory rebasing step %d", k->step);
    rfi_kir_liveness(k, live);
    for (int b = 0; b < k->n_bases; b++) {
        rfi_kir_base *base = &k->bases[b];
        int64_t c = shared_offset(k, live, b);
        size_t shift = (size_t)c * rf_dtype_size(base->dtype);
        if (c == 0 || shift > base->nbytes)
            continue;
        base->offset += shift;
        base->nbytes -= shift;
        /* in place: the hash-consing table is not consulted after lowering */
        for (int id = 0; id < k->n_ins; id++)
            if (live[id] && k->ins[id].op == RFI_KIR_LOAD && k->ins[id].base == b)
                k->ins[id].a = k->ins[k->ins[id].a].a;
        for (int s = 0; s < k->n_stores; s++)
            if (k->stores[s].base == b)
                k->stores[s].index = k->ins[k->stores[s].index].a;
    }
    rfi_free(live);
    return RF_OK;
}

void rfi_kir_liveness(const rfi_kir_kernel *k, bool *live)
{
    memset(live, 0, (size_t)k->n_ins * sizeof(bool));
    for (int s = 0; s < k->n_stores; s++) {
        live[k->stores[s].index] = true;
        live[k->stores[s].value] = true;
    }
    for (int j = 0; j < k->n_folds; j++)
        if (rfi_kir_fold_value(k, j) >= 0)
            live[rfi_kir_fold_value(k, j)] = true;
    if (k->red_guard >= 0)
        live[k->red_guard] = true;
    for (int id = k->n_ins - 1; id >= 0; id--) {
        if (!live[id])
            continue;
        const rfi_kir_ins *x = &k->ins[id];
        if (x->a >= 0)
            live[x->a] = true;
        if (x->b >= 0)
            live[x->b] = true;
        if (x->c >= 0)
            live[x->c] = true;
    }
}

/* ---- Coalescing loops -------------------------------------------------------------- *
 * Two adjacent loops d (outer) and e = d + 1 (inner), both outer or both reduced,
 * merge into one loop w over D_d * D_e points (w = i_d * D_e + i_e: the same
 * points in the same order) when every value the kernel needs depends on i_d
 * and i_e only through w. Forward over the instructions (operands come first),
 * each one's dependence on (i_d, i_e) is classified: AFFINE with coefficients
 * (cd, ce) through index additions and constant products, FUNC_W (a function of
 * w alone: an op whose index operands are affine with cd = D_e * ce, or
 * themselves FUNC_W), or BAD. The merge holds when no store, fold or guard is
 * BAD (or affine with other coefficients). The kernel is then rebuilt with i_d
 * replaced by 0 and i_e by w, through the emitters (folding again). */
enum { DEP_AFFINE, DEP_FUNC_W, DEP_BAD };

typedef struct loop_dep {
    int kind;
    int64_t cd, ce;
} loop_dep;

static bool dep_merges(loop_dep x, int64_t de)
{
    return x.kind == DEP_FUNC_W || (x.kind == DEP_AFFINE && x.cd == de * x.ce);
}

static loop_dep dep_of_op(const loop_dep *dep, const rfi_kir_ins *x, int64_t de)
{
    loop_dep r = {DEP_AFFINE, 0, 0};
    int ops[3] = {x->a, x->b, x->c};
    for (int i = 0; i < 3; i++) {
        if (ops[i] < 0)
            continue;
        loop_dep o = dep[ops[i]];
        if (o.kind == DEP_AFFINE && o.cd == 0 && o.ce == 0)
            continue;
        if (!dep_merges(o, de))
            return (loop_dep){DEP_BAD, 0, 0};
        r.kind = DEP_FUNC_W;
    }
    return r;
}

static loop_dep dep_of(const rfi_kir_kernel *k, const loop_dep *dep, int id, int d, int64_t de)
{
    const rfi_kir_ins *x = &k->ins[id];
    int64_t c;
    switch (x->op) {
    case RFI_KIR_VAR: return (loop_dep){DEP_AFFINE, x->var == d, x->var == d + 1};
    case RFI_KIR_CONST:
    case RFI_KIR_ACC: return (loop_dep){DEP_AFFINE, 0, 0};
    case RFI_KIR_IADD: {
        loop_dep a = dep[x->a], b = dep[x->b];
        if (a.kind == DEP_AFFINE && b.kind == DEP_AFFINE)
            return (loop_dep){DEP_AFFINE, a.cd + b.cd, a.ce + b.ce};
        return dep_of_op(dep, x, de);
    }
    case RFI_KIR_IMUL: {
        int other = rfi_kir_is_const(k, x->b, &c) ? x->a
                    : rfi_kir_is_const(k, x->a, &c) ? x->b : -1;
        if (other >= 0 && dep[other].kind == DEP_AFFINE)
            return (loop_dep){DEP_AFFINE, dep[other].cd * c, dep[other].ce * c};
        return dep_of_op(dep, x, de);
    }
    default: return dep_of_op(dep, x, de);
    }
}

/* Whether loops d and d + 1 merge (see above); dep: scratch per instruction. */
static bool loops_merge(const rfi_kir_kernel *k, int d, loop_dep *dep)
{
    int64_t de = var_extent(k, d + 1);
    if (de <= 0 || var_extent(k, d) <= 0 || (d < k->rank) != (d + 1 < k->rank))
        return false;
    for (int id = 0; id < k->n_ins; id++)
        dep[id] = dep_of(k, dep, id, d, de);
    for (int s = 0; s < k->n_stores; s++)
        if (!dep_merges(dep[k->stores[s].index], de) || !dep_merges(dep[k->stores[s].value], de))
            return false;
    for (int j = 0; j < k->n_folds; j++)
        if (rfi_kir_fold_value(k, j) >= 0 && !dep_merges(dep[rfi_kir_fold_value(k, j)], de))
            return false;
    return k->red_guard < 0 || dep_merges(dep[k->red_guard], de);
}

/* Instruction x of the old kernel rebuilt in n (operands already mapped by map). */
static int replay_ins(rfi_kir_kernel *n, const rfi_kir_ins *x, const int *map, int d)
{
    int a = x->a >= 0 ? map[x->a] : -1, b = x->b >= 0 ? map[x->b] : -1;
    int c = x->c >= 0 ? map[x->c] : -1;
    switch (x->op) {
    case RFI_KIR_VAR:
        return x->var == d ? rfi_kir_const_i(n, RF_I64, 0)
                           : rfi_kir_var(n, x->var > d ? x->var - 1 : x->var);
    case RFI_KIR_CONST:
        return rfi_dtype_is_float(x->dtype) ? rfi_kir_const_f(n, x->dtype, x->f)
                                            : rfi_kir_const_i(n, x->dtype, x->i);
    case RFI_KIR_ICMP: return rfi_kir_icmp(n, x->cmp, a, b);
    case RFI_KIR_LAND: return rfi_kir_land(n, a, b);
    case RFI_KIR_LOAD: return rfi_kir_load(n, x->base, a, x->node);
    case RFI_KIR_UNARY: return rfi_kir_unary(n, x->ir_op, x->dtype, a, x->node);
    case RFI_KIR_BINARY: return rfi_kir_binary(n, x->ir_op, x->dtype, a, b, x->node);
    case RFI_KIR_COMPARE: return rfi_kir_compare(n, x->cmp, a, b, x->node);
    case RFI_KIR_SELECT: return rfi_kir_select(n, a, b, c, x->node);
    case RFI_KIR_CONVERT: return rfi_kir_convert(n, x->dtype, a, x->node);
    case RFI_KIR_ROUND_BF16: return rfi_kir_round_bf16(n, a, x->node);
    case RFI_KIR_ACC: return rfi_kir_acc_of(n, (int)x->i);
    default: return rfi_kir_index(n, x->op, a, b);
    }
}

/* k with loops d and d + 1 merged, or NULL (out of memory). */
static rfi_kir_kernel *merge_loops(const rfi_kir_kernel *k, int d)
{
    rfi_kir_kernel *n = rfi_kir_kernel_new(k->step);
    int *map = rfi_malloc(((size_t)k->n_ins + 1) * sizeof *map);
    rfi_kir_base *bases = rfi_malloc(((size_t)k->n_bases + 1) * sizeof *bases);
    if (!n || !map || !bases) {
        rfi_kir_kernel_free(n);
        rfi_free(map);
        rfi_free(bases);
        return NULL;
    }
    memcpy(n->name, k->name, sizeof n->name);
    memcpy(bases, k->bases, (size_t)k->n_bases * sizeof *bases);
    n->bases = bases;
    n->n_bases = n->cap_bases = k->n_bases;
    int64_t ext[2 * RF_MAX_RANK];
    int nv = k->rank + k->red_rank;
    for (int v = 0; v < nv; v++)
        ext[v] = var_extent(k, v);
    ext[d + 1] *= ext[d];
    n->rank = d < k->rank ? k->rank - 1 : k->rank;
    n->red_rank = d < k->rank ? k->red_rank : k->red_rank - 1;
    for (int v = 0, w = 0; v < nv; v++) {
        if (v == d)
            continue;
        if (w < n->rank)
            n->dims[w] = ext[v];
        else
            n->red_dims[w - n->rank] = ext[v];
        w++;
    }
    n->is_reduce = k->is_reduce;
    n->no_simd = k->no_simd;
    n->red_kind = k->red_kind;
    n->acc_dtype = k->acc_dtype;
    n->red_identity_f = k->red_identity_f;
    n->red_identity_i = k->red_identity_i;
    for (int id = 0; id < k->n_ins; id++)
        map[id] = replay_ins(n, &k->ins[id], map, d);
    n->red_value = k->red_value >= 0 ? map[k->red_value] : -1;
    n->n_folds = k->n_folds;
    for (int j = 1; j < k->n_folds; j++) {
        int v = k->sibling_values[j - 1];
        n->sibling_values[j - 1] = v >= 0 ? map[v] : -1;
    }
    n->red_guard = k->red_guard >= 0 ? map[k->red_guard] : -1;
    int64_t always;
    if (n->red_guard >= 0 && rfi_kir_is_const(n, n->red_guard, &always) && always)
        n->red_guard = -1;
    rf_status st = RF_OK;
    for (int s = 0; s < k->n_stores && st == RF_OK; s++)
        st = rfi_kir_add_store(n, k->stores[s].base, map[k->stores[s].index],
                               map[k->stores[s].value], k->stores[s].node);
    rfi_free(map);
    if (st != RF_OK || rfi_kir_failed(n)) {
        rfi_kir_kernel_free(n);
        return NULL;
    }
    return n;
}

rf_status rfi_kir_coalesce(rfi_kir_kernel **kp)
{
    rfi_kir_kernel *k = *kp;
    loop_dep *dep = rfi_malloc(((size_t)k->n_ins + 1) * sizeof *dep);
    if (!dep)
        return rfi_error(RF_E_NOMEM, "kir: out of memory coalescing step %d", k->step);
    bool merged = true;
    while (merged) {
        merged = false;
        for (int d = k->rank + k->red_rank - 2; d >= 0 && !merged; d--) {
            if (!loops_merge(k, d, dep))
                continue;
            rfi_kir_kernel *n = merge_loops(k, d);
            loop_dep *grown = n ? rfi_realloc(dep, ((size_t)n->n_ins + 1) * sizeof *dep) : NULL;
            if (!grown) {
                rfi_kir_kernel_free(n);
                rfi_free(dep);
                return rfi_error(RF_E_NOMEM, "kir: out of memory coalescing step %d", k->step);
            }
            dep = grown;
            n->comment = k->comment;
            k->comment = NULL;
            rfi_kir_kernel_free(k);
            *kp = k = n;
            merged = true;
        }
    }
    rfi_free(dep);
    return RF_OK;
}

/* ---- Modules ---------------------------------------------------------------------- */
void rfi_kir_free(rfi_kir_module *m)
{
    if (!m)
        return;
    for (int s = 0; s < m->n_steps; s++) {
        rfi_kir_kernel_free(m->steps[s].kernel);
        rfi_free(m->steps[s].comment);
    }
    rfi_free(m->steps);
    rfi_free(m);
}

/* ---- Text form ------------------------------------------------------------------ */
static const char *const op_names[RFI_KIR_OP_COUNT] = {
    "var", "const", "iadd", "imul", "idiv", "irem", "imin", "imax", "icmp", "land",
    "load", "unary", "binary", "compare", "select", "convert", "round_bf16", "acc",
};
static const char *const cmp_names[] = {"eq", "ne", "lt", "le", "gt", "ge"};
static const char *const reduce_names[] = {"sum", "max", "min", "prod", "and", "or"};

static void print_ins(rfi_strbuf *sb, const rfi_kir_kernel *k, int id)
{
    const rfi_kir_ins *x = &k->ins[id];
    rfi_sb_printf(sb, "    v%d: %s L%d = ", id, rf_dtype_name(x->dtype), x->level);
    switch (x->op) {
    case RFI_KIR_VAR: rfi_sb_printf(sb, "var %d", x->var); break;
    case RFI_KIR_CONST:
        if (rfi_dtype_is_float(x->dtype))
            rfi_sb_printf(sb, "const %.17g", x->f);
        else
            rfi_sb_printf(sb, "const %lld", (long long)x->i);
        break;
    case RFI_KIR_LOAD: rfi_sb_printf(sb, "load b%d[v%d]", x->base, x->a); break;
    case RFI_KIR_UNARY:
    case RFI_KIR_BINARY:
        rfi_sb_printf(sb, "%s v%d", rfi_op_table[x->ir_op].name, x->a);
        if (x->b >= 0)
            rfi_sb_printf(sb, ", v%d", x->b);
        break;
    case RFI_KIR_ICMP:
    case RFI_KIR_COMPARE:
        rfi_sb_printf(sb, "%s.%s v%d, v%d", op_names[x->op], cmp_names[x->cmp], x->a, x->b);
        break;
    case RFI_KIR_SELECT: rfi_sb_printf(sb, "select v%d, v%d, v%d", x->a, x->b, x->c); break;
    case RFI_KIR_ROUND_BF16: rfi_sb_printf(sb, "round_bf16 v%d", x->a); break;
    case RFI_KIR_ACC: rfi_sb_printf(sb, x->i ? "acc %lld" : "acc", (long long)x->i); break;
    default: rfi_sb_printf(sb, "%s v%d, v%d", op_names[x->op], x->a, x->b); break;
    }
    if (x->node >= 0)
        rfi_sb_printf(sb, "  ; %%%d", x->node);
    rfi_sb_printf(sb, "\n");
}

static void print_kernel(rfi_strbuf *sb, const rfi_kir_kernel *k)
{
    rfi_sb_printf(sb, "step %d: kernel %s over [", k->step, k->name);
    for (int d = 0; d < k->rank; d++)
        rfi_sb_printf(sb, d ? ",%lld" : "%lld", (long long)k->dims[d]);
    rfi_sb_printf(sb, "]");
    if (k->is_reduce) {
        rfi_sb_printf(sb, " %s into %s over [", reduce_names[k->red_kind],
                      rf_dtype_name(k->acc_dtype));
        for (int d = 0; d < k->red_rank; d++)
            rfi_sb_printf(sb, d ? ",%lld" : "%lld", (long long)k->red_dims[d]);
        rfi_sb_printf(sb, "] fold v%d", k->red_value);
        for (int j = 1; j < k->n_folds; j++)
            rfi_sb_printf(sb, ", v%d", k->sibling_values[j - 1]);
        if (k->red_guard >= 0)
            rfi_sb_printf(sb, " if v%d", k->red_guard);
    }
    rfi_sb_printf(sb, "\n");
    if (k->comment)
        rfi_sb_printf(sb, "  %s\n", k->comment);
    for (int b = 0; b < k->n_bases; b++) {
        const rfi_kir_base *x = &k->bases[b];
        rfi_sb_printf(sb, "  b%d: buffer %d + %zu, %s, %zu bytes%s%s\n", b, x->buffer, x->offset,
                      rf_dtype_name(x->dtype), x->nbytes, x->written ? ", written" : "",
                      x->noalias ? ", noalias" : "");
    }
    for (int id = 0; id < k->n_ins; id++)
        print_ins(sb, k, id);
    for (int s = 0; s < k->n_stores; s++)
        rfi_sb_printf(sb, "    store b%d[v%d] = v%d  ; %%%d\n", k->stores[s].base,
                      k->stores[s].index, k->stores[s].value, k->stores[s].node);
}

char *rfi_kir_print(const rfi_kir_module *m)
{
    rfi_strbuf sb = {0};
    rfi_sb_printf(&sb, "kernel module: %d buffers, %d steps\n", m->n_buffers, m->n_steps);
    for (int s = 0; s < m->n_steps; s++) {
        const rfi_kir_step *st = &m->steps[s];
        switch (st->kind) {
        case RFI_KIR_STEP_KERNEL: print_kernel(&sb, st->kernel); break;
        case RFI_KIR_STEP_CALL:
        case RFI_KIR_STEP_CONV:
            rfi_sb_printf(&sb, "step %d: %s  %s\n", st->step,
                          st->kind == RFI_KIR_STEP_CALL ? "call" : "conv",
                          st->comment ? st->comment : "");
            break;
        case RFI_KIR_STEP_COPY:
            rfi_sb_printf(&sb, "step %d: copy %zu bytes buffer %d + %zu -> buffer %d + %zu  %s\n",
                          st->step, st->nbytes, st->src_buffer, st->src_offset, st->dst_buffer,
                          st->dst_offset, st->comment ? st->comment : "");
            break;
        }
    }
    if (sb.failed) {
        rfi_sb_free(&sb);
        rfi_error(RF_E_NOMEM, "kir: out of memory printing a module");
        return NULL;
    }
    return sb.data;
}
