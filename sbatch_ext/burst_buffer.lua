--[[
burst_buffer.lua: dsstage datasets the burst-buffer way, for slurmctld's burst_buffer/lua
(BurstBufferType=burst_buffer/lua; this file beside slurm.conf, linked from the package with
dsstage_submit.lua; the catalog is the one `dsstage export-catalog` keeps in /var/lib/dsstage,
a catalog beside this file only a development cluster's). A job asks for datasets with a
directive in its script or on the command line:

    #BB_LUA dataset=imagenet22t,coco          sbatch --bb "#BB_LUA dataset=coco"

which is the same request as --dataset (job_submit's check reads these directives too and
records them as it records --dataset). What each callback does, and where it runs:

  slurm_bb_job_process  (inside slurmctld, at submit: returns at once) validates the
      directives with the catalog and the messages of the job_submit check; Slurm 22.05
      does not pass the user here, so restricted datasets are checked by job_submit (which
      is told the user) and by the Prolog.
  slurm_bb_data_in      (slurmscriptd, while the job pends with an expected start) asks
      the acting demand poller for its next round now (`dsstage bb nudge`), so that
      `dsstage prefetch` on the nodes backfill planned for the job starts staging at its
      next round instead of after the poller's next one; no round runs here (only the
      poller that holds the lease acts). It never fails the job: pre-staging is an
      optimisation.
  slurm_bb_paths        (inside slurmctld: returns at once) sets DSSTAGE_BB_DATASETS in
      the job's environment; the node-local paths (DSSTAGE_PATH_<NAME>) come from the
      TaskProlog, since they depend on the node.
  slurm_bb_get_status   answers `scontrol show bbstat [JOBID | dataset NAME | node HOSTLIST]`
      while slurmctld holds locks that submissions wait for: it only reads the answer
      `dsstage bb status` computed in the background (from dsstage's own files, never
      asking Slurm), and starts a new one when that is old (see dsstage.cluster.bbstat).
  slurm_bb_pre_run      (slurmscriptd, after allocation; the job's Prologs wait for it)
      records the datasets in <state_dir>/bb/<job id> (`dsstage bb record`): on 22.05 this
      is the only way a directive reaches the Prolog, which stages on the allocated nodes as
      for --dataset (the defaults file names the directory: DSSTAGE_BB_REQUESTS). If the
      record cannot be written, the job is held with the reason rather than run without
      its data.
  slurm_bb_job_teardown (slurmscriptd, at the end) forgets the record (`dsstage bb forget`);
      the Epilog releases the job's leases as for --dataset.
  the others            succeed at once.

Slurm 22.05 passes (job_id, job_script, ...) without uid, gid or the job's nodes; 23.02 adds
uid and gid (and a job_info table), which job_process then uses for the access check.
]]

local here = string.match(debug.getinfo(1, "S").source, "^@(.*/)") or "/etc/slurm/"
package.path = here .. "?.lua;" .. package.path
-- A module that fails to load (purged by configuration management, the package removed) must
-- cost only #BB_LUA dataset= requests, as in job_submit.lua: slurmctld loads this file at start
-- and takeover, and an error here would stop the burst-buffer plugin with every job it sees.
local loaded, dsstage = pcall(require, "dsstage_submit")
if loaded then
	table.insert(dsstage.catalog_search, here .. "dsstage_catalog.lua")  -- a development cluster's catalog
else
	slurm.log_error("dsstage: cannot load dsstage_submit.lua (%s): #BB_LUA dataset= requests are refused " ..
		"until it is back beside burst_buffer.lua", (string.gsub(tostring(dsstage), "%s+", " ")))
	local why = "dsstage: datasets cannot be requested now: the controller cannot load dsstage_submit.lua; " ..
		"submit without #BB_LUA dataset=, or ask the admins to reinstall dsstage"
	-- what the callbacks below use of the module: every request is refused, saying why
	dsstage = {
		bb_request = function(text)
			if type(text) == "string" and string.find(text, "#BB_LUA", 1, true) then return nil, why end
			return nil
		end,
		catalog = function() return nil, why end,
	}
end

-- the job script's text: Slurm passes the path of the script file
local function script_text(script)
	if type(script) ~= "string" then return nil end
	if string.find(script, "\n", 1, true) then return script end
	local f = io.open(script, "r")
	if not f then return nil end
	local text = f:read("*a")
	f:close()
	return text
end

-- the datasets a job's directives ask for ({} for none), or nil and a message
local function requested(script)
	local value, err = dsstage.bb_request(script_text(script))
	if err then return nil, err end
	if value == nil then return {} end
	return dsstage.parse(value)
end

local function quote(arg)
	return "'" .. string.gsub(arg, "'", "'\\''") .. "'"
end

-- dsstage's command line (from the catalog: the installation that wrote it) with args
local function command(args)
	local cat = dsstage.catalog()
	local argv = {}
	for _, a in ipairs((cat and cat.command) or { "/usr/bin/dsstage" }) do argv[#argv + 1] = quote(a) end
	for _, a in ipairs(args) do argv[#argv + 1] = quote(a) end
	return table.concat(argv, " ")
end

function slurm_bb_job_process(job_script, uid, gid)
	local names, err = requested(job_script)
	if names == nil then return slurm.ERROR, err end
	if #names == 0 then return slurm.SUCCESS end
	local cat, cerr = dsstage.catalog()
	if cat == nil then return slurm.ERROR, cerr end
	return dsstage.validate(cat, names, uid)
end

function slurm_bb_pools()
	return slurm.SUCCESS
end

function slurm_bb_setup(job_id, uid, gid, pool, bb_size, job_script)
	return slurm.SUCCESS
end

function slurm_bb_data_in(job_id, job_script, uid, gid)
	local names = requested(job_script)
	if names and #names > 0 then
		local rc = os.execute(command({ "bb", "nudge", tostring(job_id) }) .. " >/dev/null 2>&1")
		slurm.log_info("dsstage: job %s wants %s: the demand poller asked for a round now (exit %s)",
			tostring(job_id), table.concat(names, ","), tostring(rc))
	end
	return slurm.SUCCESS
end

function slurm_bb_real_size(job_id, uid, gid)
	return slurm.SUCCESS
end

function slurm_bb_paths(job_id, job_script, path_file, uid, gid)
	local names = requested(job_script)
	if names and #names > 0 then
		local f = io.open(path_file, "w")
		if f then
			f:write("DSSTAGE_BB_DATASETS=" .. table.concat(names, ",") .. "\n")
			-- whose request it is: a job this one submits inherits the variables, not the request
			f:write("DSSTAGE_BB_JOB=" .. tostring(job_id) .. "\n")
			f:close()
		end
	end
	return slurm.SUCCESS
end

-- the Prolog waits for this: record the request where the job's Prologs read it
function slurm_bb_pre_run(job_id, job_script, uid, gid)
	local names, err = requested(job_script)
	-- a request that cannot be read now (the module is gone) stops the job: without its record it
	-- would run without its datasets and without a word
	if names == nil then return slurm.ERROR, err end
	if #names == 0 then return slurm.SUCCESS end
	local value = table.concat(names, ",")
	local p = io.popen(command({ "bb", "record", tostring(job_id), value }) .. " 2>&1; echo \"dsstage-exit=$?\"")
	local out = p and p:read("*a") or ""
	if p then p:close() end
	if not string.find(out, "dsstage%-exit=0%s*$") then
		-- without the record the job would run without its datasets and without a word
		local why = string.gsub(string.gsub(out, "dsstage%-exit=%d+%s*$", ""), "%s+", " ")
		slurm.log_error("dsstage: job %s: recording #BB_LUA dataset=%s failed: %s", tostring(job_id), value, why)
		return slurm.ERROR, "dsstage could not record the #BB_LUA dataset=" .. value .. " request for the Prolog: " .. why
	end
	return slurm.SUCCESS
end

function slurm_bb_post_run(job_id, job_script, uid, gid)
	return slurm.SUCCESS
end

function slurm_bb_data_out(job_id, job_script, uid, gid)
	return slurm.SUCCESS
end

-- Slurm 24.05 and later poll these until they stop answering "BUSY" (and refuse to start
-- without them); 22.05 never calls them. Pre-staging is an optimisation the Prolog does not
-- wait for, so the stage-in is done as soon as data_in has run, and there is no stage-out.
function slurm_bb_test_data_in(job_id, ...)
	return slurm.SUCCESS
end

function slurm_bb_test_data_out(job_id, ...)
	return slurm.SUCCESS
end

function slurm_bb_job_teardown(job_id, job_script, hurry, uid, gid)
	os.execute(command({ "bb", "forget", tostring(job_id) }) .. " >/dev/null 2>&1")
	return slurm.SUCCESS
end

-- scontrol show bbstat [JOBID | job JOBID | dataset NAME | node HOSTLIST]
--
-- slurmctld holds locks submissions need while this runs: it starts nothing that waits and
-- never calls back into Slurm. It reads the answer `dsstage bb status` computed before (in
-- the catalog's bbstat.dir; first line: when) and, when that is missing or older than
-- bbstat.max_age, starts one in the background for the next caller (dsstage.cluster.bbstat).
local USAGE = "usage: scontrol show bbstat [JOBID | job JOBID | dataset NAME | node HOSTLIST]\n"

-- Whether this Slurm passes the caller's uid and gid before the words: 23.02 and later do
-- (24.11 as strings), 22.05 passes only the words after "bbstat". The catalog says which
-- series `dsstage export-catalog` found; where it does not, two leading numbers are taken
-- for them (on 22.05 a caller could then name any uid: only the series tells).
local function passes_uid(cat, args)
	local series = dsstage.series(cat)
	if series then return series >= 2302 end
	return args[2] ~= nil and string.match(tostring(args[1]), "^%d+$") ~= nil
		and string.match(tostring(args[2]), "^%d+$") ~= nil
end

-- The question asked, as the key of its answer (nil: not a question bbstat answers).
local function question(cat, ...)
	local args = { ... }
	local uid
	if passes_uid(cat, args) then
		uid = tonumber(args[1])
		table.remove(args, 1)
		table.remove(args, 1)
	end
	local what, value = args[1], args[2]
	if what ~= nil and string.match(what, "^%d+$") and value == nil then
		what, value = "job", what
	end
	local key = "all"
	if what ~= nil then
		if (what ~= "job" and what ~= "dataset" and what ~= "node") or value == nil or #args > 2
			or #value > 200 or not string.match(value, "^[%w%[%],._-]+$") then
			return nil
		end
		key = what .. "=" .. value
	end
	if uid ~= nil then key = key .. "@" .. string.format("%d", uid) end
	return key
end

local function read_answer(path)
	local f = io.open(path, "r")
	if f == nil then return nil end
	local when = tonumber(string.match(f:read("*l") or "", "^%-%- dsstage bbstat (%d+)$"))
	local text = f:read("*a")
	f:close()
	return when, text
end

-- Start `dsstage bb status KEY` detached, unless one for KEY started less than 20 s ago
-- (one that died before it could say so blocks no longer).
local function refresh(dir, key, now)
	local mark = dir .. "/" .. key .. ".refreshing"
	local f = io.open(mark, "r")
	if f ~= nil then
		local started = tonumber(f:read("*l") or "")
		f:close()
		if started ~= nil and now - started < 20 then return end
	end
	f = io.open(mark, "w")
	if f == nil then return end
	f:write(tostring(now) .. "\n")
	f:close()
	os.execute("setsid -f timeout -k 5 60 " .. command({ "bb", "status", key }) .. " </dev/null >/dev/null 2>&1")
end

function slurm_bb_get_status(...)
	local cat, cerr = dsstage.catalog()
	if cat == nil then return slurm.SUCCESS, cerr .. "\n" end
	local key = question(cat, ...)
	if key == nil then return slurm.SUCCESS, USAGE end
	if type(cat.bbstat) ~= "table" or type(cat.bbstat.dir) ~= "string" then
		return slurm.SUCCESS, "dsstage: the catalog names no bbstat directory: an admin must run " ..
			"`dsstage export-catalog` as root on this host\n"
	end
	local now = os.time()
	local when, text = read_answer(cat.bbstat.dir .. "/" .. key)
	local age = when and (now - when) or nil
	local old = age == nil or age > (tonumber(cat.bbstat.max_age) or 10)
	if old then refresh(cat.bbstat.dir, key, now) end
	if text == nil then
		return slurm.SUCCESS, "dsstage: the answer is being computed (never in slurmctld's time); " ..
			"ask again in a few seconds\n"
	end
	if old then
		text = "(computed " .. (age and (age .. " s ago") or "at an unknown time") ..
			"; a newer answer is being computed)\n" .. text
	end
	return slurm.SUCCESS, text
end
