"""What the checker knows about torch without importing it.

The tables are deliberately explicit: a name missing here costs a missed finding, a
name wrongly here costs a false positive on every project that calls it.
"""

# torch.<name>(...) returns one tensor.
TENSOR_FUNCTIONS = frozenset("""
    abs add addcdiv addcmul arange argmax argmin argsort as_strided as_tensor asarray
    atleast_1d bincount bucketize cartesian_prod cat clamp clip clone column_stack
    combinations concat concatenate count_nonzero cummax_indices cumprod cumsum diag diff
    div dstack empty empty_like empty_strided eye flatten flip fliplr flipud floor_divide
    fmod from_dlpack from_numpy frombuffer full full_like gather hstack index_add
    index_copy index_fill index_put index_reduce index_select linspace logspace
    masked_fill masked_scatter masked_select mul multinomial narrow narrow_copy neg
    nonzero ones ones_like permute rand rand_like randint randint_like randn randn_like
    randperm range remainder repeat_interleave reshape roll row_stack scatter
    scatter_add scatter_reduce searchsorted select squeeze stack sub take
    take_along_dim tensor tile transpose tril_indices triu_indices unique
    unique_consecutive unsqueeze vstack where zeros zeros_like
    eq ne lt le gt ge isin logical_and logical_or logical_not logical_xor isnan isinf
    isfinite isneginf isposinf isreal signbit
    """.split())

# torch.<name>(...) whose result is a bool tensor whatever its inputs.
BOOL_FUNCTIONS = frozenset("""
    eq ne lt le gt ge isin logical_and logical_or logical_not logical_xor isnan isinf
    isfinite isneginf isposinf isreal signbit
    """.split())

# torch.<name>(...) returning several tensors (a tuple, a named tuple or a list).
TENSOR_TUPLE_FUNCTIONS = frozenset("""
    aminmax broadcast_tensors chunk dsplit hsplit kthvalue meshgrid mode sort split
    tensor_split topk unbind vsplit
    """.split())

# These return several tensors only when asked to: torch.unique(x, return_counts=True).
TUPLE_KEYWORDS = {
    "unique": ("return_inverse", "return_counts"),
    "unique_consecutive": ("return_inverse", "return_counts"),
    "nonzero": ("as_tuple",),
}

# Concatenations: their result may repeat ids that each input holds once.
CONCATENATIONS = frozenset(
    "cat concat concatenate stack hstack vstack dstack column_stack row_stack".split()
)

# De-duplication: what comes out holds each value once.
DEDUPLICATIONS = frozenset("unique".split())

# Functions that keep the ids of their first argument as they are (shape, device,
# dtype): a tensor of possibly repeated ids stays one.
ID_PRESERVING = frozenset("""
    as_tensor asarray atleast_1d clone flatten flip fliplr flipud from_numpy narrow
    narrow_copy permute reshape roll squeeze tensor transpose unsqueeze
    """.split())

# tensor.<name>(...) returns a tensor of the same ids (device, dtype or shape change).
SAME_IDS_METHODS = frozenset("""
    clone contiguous cpu cuda detach flatten flip int long narrow permute pin_memory
    ravel reshape reshape_as roll short squeeze t to transpose type type_as unsqueeze
    view view_as
    """.split())

# tensor.<name>(...) returns some other tensor.
TENSOR_METHODS = SAME_IDS_METHODS | frozenset("""
    abs add argsort bool clamp cumsum div expand expand_as floor_divide gather
    index_select masked_fill masked_select mul new_empty new_full new_ones new_tensor
    new_zeros nonzero remainder repeat repeat_interleave sub take unique
    unique_consecutive
    eq ne lt le gt ge isin logical_and logical_or logical_not logical_xor isnan isinf
    isfinite
    """.split())

BOOL_METHODS = frozenset("""
    bool eq ne lt le gt ge isin logical_and logical_or logical_not logical_xor isnan
    isinf isfinite
    """.split())

# Methods that reshape a 0-dim element into a tensor with a dimension again.
RESHAPING_METHODS = frozenset("flatten ravel reshape unsqueeze view expand repeat".split())

# tensor.<name>(...) returning several tensors.
TENSOR_TUPLE_METHODS = frozenset("chunk kthvalue mode sort split tensor_split topk unbind".split())

# tensor.<name>(...) returning a Python int.
INT_METHODS = frozenset("numel nelement dim ndimension element_size get_device data_ptr".split())

# Methods that only torch tensors have: `x.cuda()` makes x a tensor even when nothing
# else says so. numpy shares `flatten`, but the issue counts it; `view`, `reshape`
# and `unique` are too common elsewhere (numpy, memoryview, pandas) to count.
TORCH_ONLY_METHODS = frozenset("""
    to cuda cpu long int short contiguous pin_memory detach unsqueeze flatten
    masked_select index_select new_tensor new_zeros new_ones new_empty new_full
    type_as view_as
    """.split())

# Attributes of a tensor that are tensors.
TENSOR_ATTRIBUTES = frozenset("T mT H mH data".split())

# Fields of torch's named tuples (sort, topk, max(dim), ...) that are tensors.
TUPLE_TENSOR_FIELDS = frozenset("values indices".split())

# Annotation names (last dotted part) that mean "a torch tensor".
TENSOR_TYPES = frozenset(
    "Tensor LongTensor IntTensor ShortTensor ByteTensor CharTensor BoolTensor".split()
)
BOOL_TENSOR_TYPES = frozenset(("BoolTensor",))

# jaxtyping / torchtyping style annotations: Int[Tensor, "n"], Bool[torch.Tensor, "n"].
DTYPE_ANNOTATIONS = frozenset(
    "Int Int8 Int16 Int32 Int64 UInt8 Integer Shaped Num Bool Float Real".split()
)
BOOL_DTYPE_ANNOTATIONS = frozenset(("Bool",))

BOOL_DTYPES = frozenset(("torch.bool", "bool"))
