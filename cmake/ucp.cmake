# Build conventions for ucp (see README "Repository layout").
#
#   ucp_add_module(<name> SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
#     One static library `ucp_<name>` (alias `ucp::<name>`). DEPS are other ucp
#     modules (public), PRIVATE_DEPS the heavy third-party targets that only this
#     module may see. Headers are included as "engine/<module>/<file>.h" etc.
#
#   ucp_add_test(<name> SOURCES ... [DEPS ...] [LABELS ...] [ENV ...]
#                [FIXTURES_REQUIRED ...] [FIXTURES_SETUP ...])
#     One GoogleTest binary; each of its test cases is its own ctest test
#     (gtest_discover_tests at ctest time), so `ctest -j` spreads them. Built
#     as one unity TU per binary at -O0 (see UCP_TEST_COMPILE_FLAGS): file-local
#     helpers of a binary's sources must not share a name (shared ones go to
#     the directory's *_testutil.h); a binary that needs one TU per source sets
#     UNITY_BUILD OFF.
#
#   ucp_add_sanitized_modules(<module> ...)
#     One more static library per module, `ucp_san_<module>`, compiled with
#     -fsanitize=address,undefined (once, in tests/: every sanitized test and
#     fuzz replay links them).
#
#   ucp_add_sanitized_test(<name> SOURCES ... MODULES ... [LABELS ...])
#     The same as ucp_add_test, compiled with the sanitizers and linked with
#     the listed modules' sanitized libraries (used by tests/malformed).

set_property(GLOBAL PROPERTY UCP_MODULES "")

# Modules build as unity TUs (up to 8 sources each: headers parsed once per
# batch; a fresh build of the modules and their sanitized copies takes less
# than half the CPU time). So the sources of one module must not define two
# file-local names alike (anonymous namespaces share the TU). GCC's
# -Wsubobject-linkage (a type of an anonymous namespace used in a class
# declared in a header) is off for them: in a unity TU every source counts as
# a header. A generated source (in the build tree) compiles on its own, after
# the rule of its own directory made it.
function(_ucp_unity target sources)
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON)
  foreach(src IN LISTS sources)
    get_filename_component(abs "${src}" ABSOLUTE)
    if(abs MATCHES "^${PROJECT_BINARY_DIR}/")
      set_source_files_properties(${src} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    endif()
  endforeach()
endfunction()

function(ucp_add_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target ucp_${name})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(ucp::${name} ALIAS ${target})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(${target} PRIVATE ${UCP_WARNING_FLAGS} -Wno-subobject-linkage)
  _ucp_unity(${target} "${ARG_SOURCES}")
  if(ARG_DEPS)
    target_link_libraries(${target} PUBLIC ${ARG_DEPS})
  endif()
  if(ARG_PRIVATE_DEPS)
    target_link_libraries(${target} PRIVATE ${ARG_PRIVATE_DEPS})
  endif()
  # Remember absolute sources and deps for sanitized re-builds.
  set(abs_sources "")
  foreach(src IN LISTS ARG_SOURCES)
    get_filename_component(abs "${src}" ABSOLUTE)
    list(APPEND abs_sources "${abs}")
  endforeach()
  set_property(GLOBAL PROPERTY UCP_MODULE_${name}_SOURCES "${abs_sources}")
  set_property(GLOBAL PROPERTY UCP_MODULE_${name}_PRIVATE_DEPS "${ARG_PRIVATE_DEPS}")
  set_property(GLOBAL PROPERTY UCP_MODULE_${name}_DEPS "${ARG_DEPS}")
  set_property(GLOBAL APPEND PROPERTY UCP_MODULES ${name})
endfunction()

# Test code at -O0 (after the build type's -O3, so it wins): GoogleTest's macros
# compile about 25% faster than at -O1 (30% more at -O3), and the work a test
# does runs in the modules it links, which keep the build type's flags. With
# the unity build (GoogleTest's headers parsed once per binary).
set(UCP_TEST_COMPILE_FLAGS $<$<NOT:$<CONFIG:Debug>>:-O0>)

# GoogleTest's and GoogleMock's headers, precompiled once per flag set
# (`kind`: test, san) and reused by every test binary of that set: parsing
# them was about a seventh of each test TU's compile time (1.1 of 7.5 s of
# CPU at -O0), repeated over some seventy TUs. A precompiled header that does
# not match is ignored by GCC (the headers are parsed again), never wrong.
function(_ucp_test_pch target kind)
  set(base ucp_test_pch_${kind})
  if(NOT TARGET ${base})
    set(src ${PROJECT_BINARY_DIR}/${base}.cc)
    file(GENERATE OUTPUT ${src} CONTENT "// The target that precompiles GoogleTest's headers.\n")
    add_library(${base} OBJECT ${src})
    if(kind STREQUAL "san")
      target_compile_options(${base} PRIVATE ${UCP_WARNING_FLAGS} ${UCP_SAN_COMPILE_FLAGS})
    else()
      target_compile_options(${base} PRIVATE ${UCP_WARNING_FLAGS} ${UCP_TEST_COMPILE_FLAGS})
    endif()
    target_link_libraries(${base} PRIVATE GTest::gmock GTest::gtest)
    target_precompile_headers(${base} PRIVATE <gtest/gtest.h> <gmock/gmock.h>)
  endif()
  # With UCP_BUILD_PYTHON the tree is position-independent (-fPIC for the
  # libraries, -fPIE for executables): GCC refuses a header precompiled with
  # the other. Test binaries need neither (Debian's GCC makes PIE anyway).
  set_target_properties(${base} ${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_precompile_headers(${target} REUSE_FROM ${base})
  # A binary whose definitions differ compiles as without it (GCC warns).
  target_compile_options(${target} PRIVATE -Wno-error=invalid-pch)
endfunction()

function(ucp_add_test name)
  cmake_parse_arguments(ARG "" "WORKING_DIRECTORY"
    "SOURCES;DEPS;LABELS;ENV;FIXTURES_REQUIRED;FIXTURES_SETUP" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE ${UCP_WARNING_FLAGS} ${UCP_TEST_COMPILE_FLAGS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  set_target_properties(${name} PROPERTIES UNITY_BUILD ON)
  # LibTorch's definitions (_GLIBCXX_USE_CXX11_ABI...) would not match it.
  if(NOT "torch" IN_LIST ARG_DEPS)
    _ucp_test_pch(${name} test)
  endif()
  _ucp_discover(${name})
endfunction()

# The sources and private third-party deps of ucp modules `modules`, for
# executables that compile them again with other flags (sanitizers, fuzzing).
function(ucp_module_sources modules out_sources out_deps)
  set(srcs_all "")
  set(deps_all "")
  foreach(module IN LISTS modules)
    get_property(srcs GLOBAL PROPERTY UCP_MODULE_${module}_SOURCES)
    get_property(deps GLOBAL PROPERTY UCP_MODULE_${module}_PRIVATE_DEPS)
    list(APPEND srcs_all ${srcs})
    list(APPEND deps_all ${deps})
  endforeach()
  set(${out_sources} ${srcs_all} PARENT_SCOPE)
  set(${out_deps} ${deps_all} PARENT_SCOPE)
endfunction()

set(UCP_SAN_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
    -fno-omit-frame-pointer)
# -Og: sanitized code compiles 2x faster than at -O1 (about as fast as at
# -O0, within 10 %) and runs the malformed-input tests 3x faster than -O0
# code (std:: accessors inlined; torch_dist's cut-and-flipped ranks 16.5 ->
# 6 s); the libFuzzer builds keep -O1. -g1: line tables only (the
# sanitizers' reports keep file:line; 10 % less compile time than -g).
set(UCP_SAN_COMPILE_FLAGS ${UCP_SAN_FLAGS} -Og -g1)

function(ucp_add_sanitized_modules)
  foreach(module IN LISTS ARGN)
    set(target ucp_san_${module})
    get_property(srcs GLOBAL PROPERTY UCP_MODULE_${module}_SOURCES)
    get_property(private_deps GLOBAL PROPERTY UCP_MODULE_${module}_PRIVATE_DEPS)
    get_property(deps GLOBAL PROPERTY UCP_MODULE_${module}_DEPS)
    add_library(${target} STATIC ${srcs})
    _ucp_unity(${target} "${srcs}")
    target_compile_options(${target} PRIVATE ${UCP_WARNING_FLAGS} ${UCP_SAN_COMPILE_FLAGS}
                                             -Wno-subobject-linkage)
    target_link_options(${target} INTERFACE ${UCP_SAN_FLAGS})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR})
    # ucp::<dep> -> its sanitized library (created earlier in ARGN), also
    # inside $<LINK_LIBRARY:WHOLE_ARCHIVE,ucp::<dep>> (export links the
    # name maps whole: else its sanitized copy would link the unsanitized
    # names).
    foreach(dep IN LISTS deps)
      if(dep MATCHES "WHOLE_ARCHIVE,ucp::([a-z_]+)>")
        set_property(GLOBAL APPEND PROPERTY UCP_SAN_WHOLE_MODULES ${CMAKE_MATCH_1})
        set_property(GLOBAL APPEND PROPERTY UCP_SAN_WHOLE_BY_${CMAKE_MATCH_1} ${module})
      endif()
    endforeach()
    list(TRANSFORM deps REPLACE "ucp::" "ucp_san_")
    target_link_libraries(${target} PUBLIC ${deps} ${private_deps})
  endforeach()
endfunction()

# An executable of `sources` compiled with the sanitizers and linked with the
# sanitized libraries of `modules` (which bring the include path and the
# sanitizer link flags).
function(ucp_add_sanitized_executable name sources modules)
  add_executable(${name} ${sources})
  target_compile_options(${name} PRIVATE ${UCP_WARNING_FLAGS} ${UCP_SAN_COMPILE_FLAGS})
  # A module another links whole is linked whole here too (a link item may
  # not appear with two link features), and not at all when a listed module
  # brings it (CMake does not merge the two: its objects were defined twice).
  get_property(whole GLOBAL PROPERTY UCP_SAN_WHOLE_MODULES)
  set(libs "")
  foreach(module IN LISTS modules)
    if(module IN_LIST whole)
      get_property(users GLOBAL PROPERTY UCP_SAN_WHOLE_BY_${module})
      set(brought FALSE)
      foreach(user IN LISTS users)
        if(user IN_LIST modules)
          set(brought TRUE)
        endif()
      endforeach()
      if(NOT brought)
        list(APPEND libs "$<LINK_LIBRARY:WHOLE_ARCHIVE,ucp_san_${module}>")
      endif()
    else()
      list(APPEND libs ucp_san_${module})
    endif()
  endforeach()
  target_link_libraries(${name} PRIVATE ${libs})
endfunction()

function(ucp_add_sanitized_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;MODULES;DEPS;LABELS;ENV;FIXTURES_REQUIRED;FIXTURES_SETUP" ${ARGN})
  ucp_add_sanitized_executable(${name} "${ARG_SOURCES}" "${ARG_MODULES}")
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  _ucp_test_pch(${name} san)
  # The defaults first: a test's own ENV entries override them.
  list(PREPEND ARG_ENV "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1"
                       "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
  _ucp_discover(${name})
endfunction()

# Registers every test case of GoogleTest binary <name> as ctest test
# `<name>.<Suite>.<Case>` with the common environment, labels and fixtures
# (listing happens when ctest starts: cmake/ucp_gtest_cases.cmake).
macro(_ucp_discover name)
  _ucp_env_list(_env)
  string(REPLACE ";" "\\;" _env "${_env}")
  # Skipped cases (GTEST_SKIP) are reported as skipped, not passed; every
  # case has a time limit.
  set(_props "ENVIRONMENT;${_env};SKIP_REGULAR_EXPRESSION;\\[  SKIPPED \\];TIMEOUT;${UCP_UNMEASURED_TIMEOUT}")
  foreach(_prop LABELS FIXTURES_REQUIRED FIXTURES_SETUP)
    if(ARG_${_prop})
      string(REPLACE ";" "\\;" _value "${ARG_${_prop}}")
      list(APPEND _props ${_prop} "${_value}")
    endif()
  endforeach()
  set(_include "${CMAKE_CURRENT_BINARY_DIR}/${name}_cases.cmake")
  file(GENERATE OUTPUT "${_include}" CONTENT
"set(UCP_CASE_EXE [==[$<TARGET_FILE:${name}>]==])
set(UCP_CASE_PREFIX [==[${name}.]==])
set(UCP_CASE_PROPS [==[${_props}]==])
set(UCP_CASE_TIMES [==[${UCP_TEST_TIMES}]==])
include([==[${PROJECT_SOURCE_DIR}/cmake/ucp_test_times.cmake]==])
include([==[${PROJECT_SOURCE_DIR}/cmake/ucp_gtest_cases.cmake]==])
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${_include}")
  ucp_default_timeouts()
endmacro()

# Registers a Python test run with Debian's system interpreter (which has
# torch 1.13), or with VENV the tests' PyPI environment (UCP_VENV_PYTHON).
#   ucp_add_python_test(<name> SCRIPT file [VENV] ARGS ... [LABELS ...] [ENV ...] [FIXTURES_...])
function(ucp_add_python_test name)
  cmake_parse_arguments(ARG "VENV" "SCRIPT" "ARGS;LABELS;ENV;FIXTURES_REQUIRED;FIXTURES_SETUP;FIXTURES_CLEANUP" ${ARGN})
  if(ARG_VENV)
    set(_py ${UCP_VENV_PYTHON})
  else()
    set(_py ${UCP_PYTHON})
  endif()
  add_test(NAME ${name} COMMAND ${_py} ${ARG_SCRIPT} ${ARG_ARGS})
  _ucp_test_properties(${name})
endfunction()

# One ctest entry per `def test_*` function of a Python test script (its
# main runs the functions named on its command line), so that ctest -j runs
# them in parallel: <prefix>.<function>. Options as ucp_add_python_test.
# ONE_PROCESS: one entry <prefix> running every function in turn, for the
# scripts whose functions would each spend seconds importing the frameworks
# (megatron-core alone takes 5 s of CPU; torch 2): a function's time is on its
# "ok <function> (<seconds> s)" line, which tests/tools/suite_times.py lists.
function(ucp_add_python_cases prefix)
  cmake_parse_arguments(ARG "VENV;ONE_PROCESS" "SCRIPT" "LABELS;ENV;FIXTURES_REQUIRED" ${ARGN})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${ARG_SCRIPT})
  file(STRINGS ${ARG_SCRIPT} _defs REGEX "^def test_[A-Za-z0-9_]+\\(")
  if(NOT _defs)
    message(FATAL_ERROR "${ARG_SCRIPT}: no test functions")
  endif()
  # Each entry runs `SCRIPT test_name`: without the runner at its end the
  # script would define the tests, run none and pass.
  file(STRINGS ${ARG_SCRIPT} _main REGEX "^if __name__ == .__main__.:")
  if(NOT _main)
    message(FATAL_ERROR "${ARG_SCRIPT}: no `if __name__ == \"__main__\":` runner "
                        "calling the test functions named on its command line")
  endif()
  set(_venv "")
  if(ARG_VENV)
    set(_venv VENV)
  endif()
  if(ARG_ONE_PROCESS)
    # One entry running every function in turn in one process (the
    # frameworks imported once; testmain prints each function's time).
    ucp_add_python_test(${prefix} ${_venv} SCRIPT ${ARG_SCRIPT}
      LABELS ${ARG_LABELS} ENV ${ARG_ENV} FIXTURES_REQUIRED ${ARG_FIXTURES_REQUIRED})
    return()
  endif()
  foreach(_def IN LISTS _defs)
    string(REGEX REPLACE "^def (test_[A-Za-z0-9_]+)\\(.*" "\\1" _fn "${_def}")
    ucp_add_python_test(${prefix}.${_fn} ${_venv} SCRIPT ${ARG_SCRIPT} ARGS ${_fn}
      LABELS ${ARG_LABELS} ENV ${ARG_ENV} FIXTURES_REQUIRED ${ARG_FIXTURES_REQUIRED})
  endforeach()
endfunction()

# Every test's environment: the data folders, the interpreters, and
# UCP_NO_SYNC=1 (scratch outputs need no fsync: a file's fsync and its folder's
# took 9 ms here, some thousands of times per run; test_staging_cli.py checks
# the fsyncs without it).
macro(_ucp_env_list out)
  set(${out} "UCP_TESTDATA=${UCP_TESTDATA_DIR}" "UCP_FIXTURES=${UCP_FIXTURES_DIR}"
             "UCP_SOURCE_DIR=${PROJECT_SOURCE_DIR}" "UCP_BINARY_DIR=${PROJECT_BINARY_DIR}"
             "UCP_PYTHON=${UCP_PYTHON}" "UCP_VENV_PYTHON=${UCP_VENV_PYTHON}"
             "UCP_NO_SYNC=1" ${ARG_ENV})
endmacro()

macro(_ucp_test_properties name)
  _ucp_env_list(_env)
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${_env}")
  ucp_default_timeouts()
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
  if(ARG_FIXTURES_REQUIRED)
    set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED "${ARG_FIXTURES_REQUIRED}")
  endif()
  if(ARG_FIXTURES_SETUP)
    set_tests_properties(${name} PROPERTIES FIXTURES_SETUP "${ARG_FIXTURES_SETUP}")
  endif()
  if(ARG_FIXTURES_CLEANUP)
    set_tests_properties(${name} PROPERTIES FIXTURES_CLEANUP "${ARG_FIXTURES_CLEANUP}")
  endif()
endmacro()

# Every test gets a time limit: at the end of each directory that registers
# tests, those without a TIMEOUT get about three times their measured time
# from tests/test_times.txt (and their PROCESSORS: the ranks they fork), or
# UCP_UNMEASURED_TIMEOUT seconds when the table has no line for them (GoogleTest
# cases get theirs when ctest lists them: _ucp_discover).
set(UCP_UNMEASURED_TIMEOUT 300 CACHE STRING "Seconds a test not in tests/test_times.txt may run (ctest TIMEOUT)")
set(UCP_TEST_TIMES ${PROJECT_SOURCE_DIR}/tests/test_times.txt)
set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${UCP_TEST_TIMES})
include(${CMAKE_CURRENT_LIST_DIR}/ucp_test_times.cmake)
function(_ucp_apply_timeouts)
  _ucp_read_test_times(${UCP_TEST_TIMES})
  get_property(_tests DIRECTORY PROPERTY TESTS)
  foreach(_t IN LISTS _tests)
    _ucp_test_limit(${_t} ${UCP_UNMEASURED_TIMEOUT} _limit _procs _secs)
    # COST: ctest -jN starts the longest tests first (a fresh build folder has
    # no cost data of its own), so that no long test starts last. A test of
    # several processors first of all: ctest (3.25) starts one only when that
    # many slots are free at once, which after the first tests happens only
    # at the end of the run (tests/README.md "Time").
    if(_secs)
      if(_procs GREATER 1)
        math(EXPR _secs "${_secs} + 100000")
      endif()
      set_tests_properties(${_t} PROPERTIES COST ${_secs})
    endif()
    get_test_property(${_t} TIMEOUT _set)
    if(NOT _set)
      set_tests_properties(${_t} PROPERTIES TIMEOUT ${_limit})
    endif()
    get_test_property(${_t} PROCESSORS _set)
    if(NOT _set AND _procs GREATER 1)
      set_tests_properties(${_t} PROPERTIES PROCESSORS ${_procs})
    endif()
  endforeach()
endfunction()
macro(ucp_default_timeouts)
  get_property(_deferred DIRECTORY PROPERTY UCP_TIMEOUTS_DEFERRED)
  if(NOT _deferred)
    set_property(DIRECTORY PROPERTY UCP_TIMEOUTS_DEFERRED TRUE)
    cmake_language(DEFER CALL _ucp_apply_timeouts)
  endif()
endmacro()
