# Installation layout (GNUInstallDirs) and the Debian package (CPack DEB).
#
#   cmake -S . -B build -DCMAKE_INSTALL_PREFIX=/usr && cmake --build build
#   cmake --install build                        # bin/demesne, libexec/demesne/demesne-init, docs, man page
#   (cd build && cpack -G DEB)                   # build/demesne_<version>_<arch>.deb
#
# Included from the top-level CMakeLists.txt after the targets are defined.

set(CMAKE_INSTALL_DEFAULT_DIRECTORY_PERMISSIONS
  OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)

install(TARGETS demesne RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# demesne-init is not a command for people: it is mounted into sandboxes. It goes where
# Debian puts a package's helper programs (/usr/libexec/demesne); `demesne` finds it there
# through core.loop.libexec_dir (see config.init_path in lua/config.lua).
if(TARGET demesne-init)
  install(TARGETS demesne-init RUNTIME DESTINATION ${DEMESNE_INSTALL_LIBEXECDIR})
endif()

# The man page, compressed the way Debian policy asks (gzip -9n: no name, no timestamp).
find_program(GZIP_EXE gzip REQUIRED)
set(DEMESNE_MAN_SRC ${CMAKE_SOURCE_DIR}/docs/man/demesne.1)
set(DEMESNE_MAN_GZ ${CMAKE_BINARY_DIR}/man/demesne.1.gz)
add_custom_command(
  OUTPUT ${DEMESNE_MAN_GZ}
  COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/man
  COMMAND ${CMAKE_COMMAND} -E copy ${DEMESNE_MAN_SRC} ${CMAKE_BINARY_DIR}/man/demesne.1
  COMMAND ${GZIP_EXE} -9nf ${CMAKE_BINARY_DIR}/man/demesne.1
  DEPENDS ${DEMESNE_MAN_SRC}
  COMMENT "Compressing the demesne(1) man page")
add_custom_target(man ALL DEPENDS ${DEMESNE_MAN_GZ})
install(FILES ${DEMESNE_MAN_GZ} DESTINATION ${CMAKE_INSTALL_MANDIR}/man1)

# Documentation: the README, the docs/ tree (its roff man source excepted) and a
# machine-readable copyright file made from LICENSE.
file(READ ${CMAKE_SOURCE_DIR}/LICENSE _license)
if(NOT _license MATCHES "Copyright \\(c\\) ([^\n]+)\n")
  message(FATAL_ERROR "LICENSE has no 'Copyright (c) ...' line")
endif()
set(DEMESNE_COPYRIGHT "${CMAKE_MATCH_1}")
string(REGEX REPLACE "^.*Copyright \\(c\\) [^\n]+\n+" "" _license "${_license}")
string(STRIP "${_license}" _license)
string(REGEX REPLACE "\n[ \t]*\n" "\n.\n" _license "${_license}")   # blank line -> " ."
string(REPLACE "\n" "\n " DEMESNE_LICENSE_TEXT " ${_license}")
configure_file(${CMAKE_SOURCE_DIR}/packaging/copyright.in ${CMAKE_BINARY_DIR}/copyright @ONLY)
install(FILES ${CMAKE_SOURCE_DIR}/README.md ${CMAKE_BINARY_DIR}/copyright DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${CMAKE_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}
  PATTERN man EXCLUDE)

# ---------------------------------------------------------------- the .deb
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME demesne)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "the demesne authors")
set(DEMESNE_DEB_MAINTAINER "the demesne authors <dev@demesne.local>" CACHE STRING
  "Maintainer field of the .deb (Name <email>)")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${DEMESNE_DEB_MAINTAINER}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "MCP server that runs untrusted commands in disposable containers")
# The extended description, wrapped for `apt show` (CPack turns a blank line into " .").
set(CPACK_PACKAGE_DESCRIPTION [[
demesne is a local MCP (Model Context Protocol) server that an AI agent such
as Claude Code or Codex drives over stdio to run untrusted shell commands,
scripts and AI coding agents in disposable Podman or Docker containers,
through the Docker Engine API.

Host inputs are mounted read-only, every run gets an output folder that
outlives the container, and sandboxes reach the network only through a host
proxy that applies an egress policy. Tools, egress policies, agent providers
and engine adapters are Lua files.

Run `demesne doctor` after installing to check the container engine, the
images, the configuration and the folders.]])
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)            # demesne_<version>_<arch>.deb
# Depends: dpkg-shlibdeps reads the ELF NEEDED entries of bin/demesne and maps each
# library to the package that ships it (libc6, liblua5.4-0, lua-cjson for
# liblua5.4-cjson.so.0, libcurl4, libuv1, libarchive13, libyaml-0-2); demesne-init is static.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# lua-yaml (lyaml, a LibYAML binding) is loaded by `require`, so no NEEDED entry names it:
# `demesne skills` reads the skills' YAML front matter with it.
set(CPACK_DEBIAN_PACKAGE_DEPENDS "lua-yaml")
# An engine to talk to, and mmdebstrap to build the base image when no registry answers.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "podman | docker.io, mmdebstrap")
# python3 (3.11: tomllib) reads ~/.codex/config.toml when host_mcp_import names codex
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "python3 (>= 3.11)")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_STRIP_FILES ON)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
include(CPack)
